"""Every operation of the int8 forward gives the same float32 bits with 1, 2, 3 and 4 threads.

Shapes are chosen to be awkward (odd widths, one row, long key ranges) so that a thread split
landing mid-vector, or a kernel that splits one reduction across threads, would show. The real
model's forest (cache hits, chunked prefill, short and long key ranges) is checked at the end.
"""
import numpy as np
import pytest
import torch

from prism_backend.config import ComputeSettings
from prism_backend.model.attention import _sdpa
from prism_backend.model.layers import RotaryTable, apply_rotary, rms_norm, swiglu
from prism_backend.model.quant import Int8Linear
from prism_backend.model.scoring import score_answer
from prism_backend.reproducibility import strict_blas_active, torch_threads

from helpers import SAMPLE_TICKET

THREADS = (1, 2, 3, 4)


def bits_per_thread_count(fn) -> set[bytes]:
    """The output bytes of fn() at each thread count; one element when thread-count invariant."""
    out = set()
    for threads in THREADS:
        with torch_threads(threads):
            result = fn()
        out.add(b"".join(t.contiguous().numpy().tobytes() for t in (result if isinstance(result, tuple) else (result,))))
    return out


def test_mkl_runs_in_strict_reproducible_mode():
    assert strict_blas_active()


@pytest.mark.parametrize("lq, lk, prefix, causal", [
    (1, 33, 32, False), (1, 740, 739, False), (1, 2100, 2099, False),  # answer rows
    (1, 1, 0, True), (2, 33, 31, True), (3, 700, 697, True), (7, 9, 2, True),  # short branches
    (33, 33, 0, True), (700, 700, 0, True), (700, 740, 40, True), (129, 1300, 1171, True),  # blocks
])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (3, 1), (4, 4)])
def test_attention(lq, lk, prefix, causal, heads, kv_heads):
    g = torch.Generator().manual_seed(lq * 7919 + lk)
    q = torch.randn(lq, heads, 64, generator=g)
    k, v = torch.randn(2, lk, kv_heads, 64, generator=g)
    assert len(bits_per_thread_count(lambda: _sdpa(q, k, v, prefix, causal))) == 1


@pytest.mark.parametrize("rows, width", [(1, 576), (7, 1537), (760, 576), (61, 4099)])
def test_rms_norm(rows, width):
    x, w = torch.randn(rows, width), torch.randn(width)
    assert len(bits_per_thread_count(lambda: rms_norm(x, w, 1e-5))) == 1


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 1531), (760, 1536), (97, 4867)])
def test_swiglu(rows, width):
    gate_up = torch.randn(rows, 2 * width) * 6
    assert len(bits_per_thread_count(lambda: swiglu(gate_up))) == 1


def test_swiglu_and_rms_norm_are_the_reference_expressions_bit_for_bit(monkeypatch):
    """The torch forms (the GPU path, and CPUs without the kernel library; the library's forms are
    tests/test_rowwise_cpu.py's) compute the textbook expressions' IEEE steps: the same bits as
    gate / (1 + exp(-gate)) * up and as Hugging Face's LlamaRMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from prism_backend.model import layers

    monkeypatch.setattr(layers, "_library_runs", lambda x: False)
    gate_up = torch.randn(97, 2 * 1531) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu(gate_up).view(torch.int32), (gate / (1.0 + torch.exp(-gate)) * up).view(torch.int32))
    x = torch.randn(61, 576) * 3
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
        assert torch.equal(rms_norm(x, norm.weight, 1e-5).view(torch.int32), norm(x).view(torch.int32))


def test_rotary():
    table = RotaryTable(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 1.0, 4096)
    positions = torch.arange(3, 3 + 1003)
    x = torch.randn(1003, 9, 64)
    assert len(bits_per_thread_count(lambda: apply_rotary(x, *table(positions)))) == 1


def test_rotary_is_hugging_faces_rotate_half_bit_for_bit():
    """apply_rotary works half by half; Hugging Face's Llama computes x * cos + rotate_half(x) * sin.
    Same bits, on the engine's layouts: q/k as views of the fused qkv output, and answer rows."""
    from transformers.models.llama.modeling_llama import rotate_half

    table = RotaryTable(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 1.0, 4096)
    cos, sin = table(torch.arange(5, 5 + 700))
    q, k, _ = (torch.randn(700, 960) * 3).split([576, 192, 192], dim=-1)
    for x in (q.reshape(-1, 9, 64), k.reshape(-1, 3, 64), q.reshape(-1, 9, 64)[[3, 99, 699]]):
        c, s = (cos, sin) if x.shape[0] == 700 else (cos[[3, 99, 699]], sin[[3, 99, 699]])
        assert torch.equal(apply_rotary(x, c, s), x * c + rotate_half(x) * s)


@pytest.mark.parametrize("route", ["int16", "float"])
@pytest.mark.parametrize("act_passes, weight_passes", [(1, 1), (2, 2)])
@pytest.mark.parametrize("rows", [1, 5, 760])
def test_int8_linear(act_passes, weight_passes, rows, route, monkeypatch):
    """The AVX2 int16 kernel splits output panels between OpenMP threads, the float route is MKL
    in strict CNR mode: neither may change a bit with the thread count."""
    from prism_backend.model import exact_matmul

    monkeypatch.setattr(exact_matmul, "_route", route)
    torch.manual_seed(rows)
    lin = Int8Linear(torch.randn(1537, 577), torch.randn(1537), ComputeSettings("int8", act_passes, weight_passes))
    x = torch.randn(rows, 577) * torch.linspace(0.1, 9, 577)
    assert len(bits_per_thread_count(lambda: lin(x))) == 1


@pytest.mark.parametrize("candidates, cap", [((49, 50, 51, 52), 64), (tuple(range(100, 170)), 64)])
def test_candidate_scoring(candidates, cap):
    torch.manual_seed(0)
    lm_head, hidden = torch.randn(49152, 576) * 0.05, torch.randn(576)
    assert len(bits_per_thread_count(lambda: torch.from_numpy(score_answer(hidden, lm_head, candidates, cap)[0]))) == 1


def test_engine_bits_with_1_to_4_threads(fp32_config):
    """The real model in int8 with the prefix cache and chunked prefill on: a ~700-token ticket
    with three questions (long key ranges, answer rows after 700 keys), a one-line ticket (short
    ones), and a new question about the first ticket (a cache hit). Recomputed without the cache
    and served from it, at every thread count: one set of bytes."""
    from prism_backend.engine.engine import DecisionEngine
    from prism_backend.text.frontend import Frontend

    from helpers import REGISTRY

    config = fp32_config.replace(precision="int8", prefix_cache_bytes=64 << 20, prefill_chunk_tokens=256,
                                 kv_block_tokens=64)
    frontend, engine = Frontend(config, REGISTRY), DecisionEngine(config)
    requests = [frontend.encode(SAMPLE_TICKET, ["team", "reply_time", "severity"], None)[0],
                frontend.encode("Refund please, charged twice.", ["team"], None)[0]]
    follow_up = [frontend.encode(SAMPLE_TICKET, ["team"], None)[0]]

    def probabilities(results):
        return [np.concatenate([s.probabilities for s in r]).tobytes() for r in results]

    with torch_threads(1):
        reference = probabilities(engine.score(requests + follow_up, use_cache=False)[0])
    for threads in THREADS[1:]:  # everything recomputed
        with torch_threads(threads):
            assert probabilities(engine.score(requests + follow_up, use_cache=False)[0]) == reference, threads
    with torch_threads(2):  # blocks computed and cached at 2 threads ...
        assert probabilities(engine.score(requests)[0]) == reference[:2]
    for threads in (3, 1):  # ... and served from the cache at 3 and 1
        with torch_threads(threads):
            results, stats = engine.score(follow_up)
            assert stats.tokens_cached > 0 and probabilities(results) == reference[2:], threads
