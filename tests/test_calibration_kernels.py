"""The calibration's float64 steps in the kernel library (kernels/cpu/calibration.py) against their torch
references, bit for bit: GPTQ's rounding of a block of columns (model/gptq.py's _round_block), the whole
of GPTQ with and without it, the Hadamard transform of the offline rotation (model/hadamard.transform),
and the rotation itself; and the Hessian's upper blocks mirrored against the full product it replaced.
The calibration cache's golden digests (test_replay.py) check the same on the embedded model."""
import math

import pytest
import torch

from kernels.cpu import calibration as calibration_kernels
from prism_backend.model import gptq as gptq_module
from prism_backend.model import hadamard, rotation
from prism_backend.model.fixed_point import to_fixed
from prism_backend.model.gptq import HESSIAN_BITS, HESSIAN_ROWS, Hessian, gptq
from prism_backend.model.loader import load_model

from helpers import needs

pytestmark = needs("avx2")


def _factor(width: int, generator: torch.Generator) -> torch.Tensor:
    """H^-1's upper Cholesky factor of a random well-conditioned H, as GPTQ computes it (LAPACK's,
    column-major: the kernel's wrapper takes any strides)."""
    x = torch.randn(4 * width, width, generator=generator, dtype=torch.float64)
    h = x.T @ x + 0.1 * torch.eye(width, dtype=torch.float64)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@pytest.mark.parametrize("rows, width, bound", [(1, 128, 127), (7, 128, 127), (300, 64, 127), (33, 128, 8191)])
def test_the_gptq_block_kernel_is_the_torch_loop(rows, width, bound):
    g = torch.Generator().manual_seed(rows + width)
    whole = torch.randn(rows, 3 * width, generator=g, dtype=torch.float64) * 4
    w = whole[:, width:2 * width]  # a view into the matrix, as gptq passes it
    s = whole.abs().amax(dim=1) / bound * torch.rand(rows, generator=g, dtype=torch.float64).add_(0.5)  # some clamp
    w[0, :4] = torch.tensor([0.5, -0.5, 1.5, 2.5], dtype=torch.float64) * s[0]  # ties: half to even
    w[-1, 4:6] = torch.tensor([0.0, -0.0], dtype=torch.float64)
    u = _factor(width, g)
    q_kernel, q_torch = torch.zeros(rows, width, dtype=torch.float64), torch.zeros(rows, width, dtype=torch.float64)
    before = w.clone()
    err_kernel = calibration_kernels.gptq_block(w, s, u, bound, q_kernel)
    err_torch = gptq_module._round_block(w, s, u, bound, q_torch)
    assert torch.equal(w, before)  # the weights are read, not written
    assert torch.equal(q_kernel, q_torch) and torch.equal(err_kernel, err_torch)
    assert torch.equal(torch.signbit(q_kernel), torch.signbit(q_torch))
    assert q_kernel.abs().max() == bound  # the clamp was reached


def test_gptq_gives_the_same_integers_with_the_kernel_and_without(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(900, 300, generator=g) @ torch.randn(300, 300, generator=g)
    x[:, 17] = 0  # a dead input
    w = torch.randn(40, 300, generator=g)
    h = x.double().T @ x.double()
    with_kernel = gptq(w, h)
    monkeypatch.setattr(calibration_kernels, "available", lambda: False)
    without = gptq(w, h)
    assert all(torch.equal(a, b) for a, b in zip(with_kernel, without))


@pytest.mark.parametrize("shape, block", [((37, 576), None), ((5, 1536), 128), ((3, 7, 64), None), ((4, 1536), None),
                                          ((6, 48), 12), ((2, 896), None), ((3, 80), 20), ((2, 8), None)])
def test_the_hadamard_kernel_is_the_torch_transform(shape, block):
    """Factorisations SmolLM2 and the other supported checkpoints use: 576 = 12 x 12 x 2 x 2, blocks of
    128 = 2^7, 64, 1536 = 12 x 2^7, 896 = 224 x 2 x 2 (a factor wider than the kernel's register
    group), a Paley factor alone (stride 1) and in blocks; signed zeros kept."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, -0.0], dtype=torch.float64)
    order = block or shape[-1]
    factors = hadamard.factors(order)
    out = calibration_kernels.hadamard_f64(x, order, factors, [hadamard.factor_matrix(f) for f in factors])
    reference = hadamard.transform(x, block)
    assert torch.equal(out, reference) and torch.equal(torch.signbit(out), torch.signbit(reference))


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_the_rotation_is_the_same_with_the_kernel_and_without(tiny_model_dir, arch, monkeypatch):
    spec, a = load_model(tiny_model_dir(arch))
    _, b = load_model(tiny_model_dir(arch))
    rotation.rotate(spec, a)
    monkeypatch.setattr(calibration_kernels, "available", lambda: False)
    rotation.rotate(spec, b)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
    for x, y in zip(a.layers, b.layers):
        for name in ("wqkv", "bqkv", "wo", "w_gate_up", "w_down"):
            assert (getattr(x, name) is None and getattr(y, name) is None) or torch.equal(getattr(x, name), getattr(y, name))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("width", [13, 96, 200, 576, 1540])
def test_the_hessian_from_its_upper_triangle_is_the_full_product(width, kernel, monkeypatch):
    """Only the entries on and above the diagonal are computed (by the kernel library's hessian_add, or
    torch's products of H's blocks); mirrored, H has the bits of the full product the calibration used
    before (every product exact, added power by power in the same order). Widths with partial tiles
    and panels; more rows of one power than one exact product takes (HESSIAN_ROWS)."""
    if not kernel:
        monkeypatch.setattr(calibration_kernels, "available", lambda: False)
    g = torch.Generator().manual_seed(width)
    h, calls = Hessian(width), []
    h.add(torch.zeros(0, width))  # no rows: nothing added
    for rows in (213, 5, 700, HESSIAN_ROWS + 300):
        x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g).mul_(8)
        if rows > HESSIAN_ROWS:
            x = torch.randn(rows, width, generator=g).clamp_(-0.7, 0.7)
            x[:, 0] = 0.75  # every row's largest |x|: one power of two for all of them
        x[:, 3] = 0
        h.add(x)
        calls.append(x)
    full = torch.zeros(width, width, dtype=torch.float64)
    for x in calls:
        q, e = to_fixed(x, HESSIAN_BITS)
        for power in torch.unique(e[:, 0]).tolist():
            for chunk in q[e[:, 0] == power].split(HESSIAN_ROWS):
                full.add_((chunk.T @ chunk).mul_(math.ldexp(1.0, 2 * power)))
    assert torch.equal(h.h, full) and torch.equal(torch.signbit(h.h), torch.signbit(full))
    assert h.rows == 918 + HESSIAN_ROWS + 300
