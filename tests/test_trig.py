"""The rotary table's cos and sin (prism_backend/model/trig.py): the correctly rounded float32 values
of the float32 angles, the same bits at any thread count -- torch's own float32 cos gave one of two
results per process on an Intel Xeon with AMX (docs/determinism-and-precision.md)."""
from __future__ import annotations

import math

import pytest
import torch

from prism_backend.model.layers import RotaryTable
from prism_backend.model.trig import cos_sin
from prism_backend.reproducibility import torch_threads


def angles() -> torch.Tensor:
    """A rotary table's angles: float32 positions x inverse frequencies (base 10^5, 64 dimensions)."""
    inv_freq = 1.0 / (100000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    return torch.arange(8192, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]


def test_cos_sin_are_the_correctly_rounded_values():
    """Against the C library's double cos and sin rounded once to float32, on every 7th angle of a
    table (x up to 8191 rad) and around the quadrant boundaries."""
    x = torch.cat([angles().flatten()[::7], torch.tensor([0.0, -0.0, 1e-30, -1.5, math.pi / 4, math.pi / 2, math.pi,
                                                          3 * math.pi / 2, -math.pi, 1e5], dtype=torch.float32)])
    cos, sin = cos_sin(x)
    values = x.double().tolist()
    assert torch.equal(cos, torch.tensor([math.cos(v) for v in values], dtype=torch.float64).float())
    assert torch.equal(sin, torch.tensor([math.sin(v) for v in values], dtype=torch.float64).float())


def test_the_table_has_the_same_bits_at_any_thread_count():
    inv_freq = 1.0 / (100000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    with torch_threads(1):
        first = RotaryTable(inv_freq, 1.0, 8192)
    for threads in (2, 3, 4):
        with torch_threads(threads):
            table = RotaryTable(inv_freq, 1.0, 8192)
        assert torch.equal(table.cos, first.cos) and torch.equal(table.sin, first.sin), threads
    assert first.cos.shape == (8192, 64) and torch.equal(first.cos[:, :32], first.cos[:, 32:])


def test_angles_beyond_the_exact_reduction_are_refused():
    with pytest.raises(ValueError, match="below"):
        cos_sin(torch.tensor([2e6]))


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_the_hf_reference_rotary_gives_the_correctly_rounded_values(tiny_model_dir, arch):
    """prism_launcher.reference.HFReference replaces its rotary modules' cos and sin with the
    correctly rounded ones of the module's own angles (torch's float32 cos differs from those in ~5% of
    a table's entries, so without the hook this fails): the C library's double cos / sin of each
    float32 angle, rounded to float32, times the module's attention scaling."""
    from prism_launcher.reference import HFReference

    model = HFReference(tiny_model_dir(arch)).model
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    positions = torch.arange(0, 4096, 3)[None, :]  # (1, N)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    angles = (positions[..., None].float() * rotary.inv_freq.float()).double().flatten().tolist()
    scaling = getattr(rotary, "attention_scaling", 1.0)
    half = cos.shape[-1] // 2
    for got, fn in ((cos, math.cos), (sin, math.sin)):
        expected = torch.tensor([fn(a) for a in angles], dtype=torch.float64).float().view(got[..., :half].shape)
        assert torch.equal(got[..., :half], expected * scaling) and torch.equal(got[..., half:], got[..., :half])
