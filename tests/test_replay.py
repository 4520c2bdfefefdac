"""Replay on any x86-64 CPU: a served decision's probabilities are a function of the request, the
checkpoint and Prism's code -- not of the CPU's vector width or vendor, its BLAS, or the thread count.

The whole path is covered: the calibration forwards (exact fixed-point products,
model/fixed_point.py), GPTQ's Hessians (exact integer sums), the served forward (Prism's CPU kernels,
golden-checked in test_rowwise_cpu / test_tree_attention_cpu / test_exact_gemm_cpu) and the
scoring (float64 products summed left to right, the C library's exp). Committed digests of the
fixed request set's probabilities, from the embedded model with the default configuration, are
recomputed here on whatever machine runs the suite (test_cpu_kinds recomputes them on the AVX2
path forced on an AVX-512 machine). Regenerate them, after a change that moves the bits on purpose,
with `.venv/bin/python tests/test_replay.py`; the file says where they were made.
"""
import hashlib
import json
import sys

import torch

from prism_backend.model.fixed_point import FixedPointLinear, operand_bits, power_of_two, to_fixed
from prism_backend.model.gptq import Hessian
from prism_backend.reproducibility import torch_threads

from helpers import GOLDEN_DECISIONS_PATH, decision_digests


def test_operand_bits_keep_every_partial_sum_exact():
    for terms in (2, 576, 1536, 18944, 1 << 20):
        bits = operand_bits(terms)
        assert terms * (1 << (2 * bits)) <= 1 << 53 < terms * (1 << (2 * bits + 2))


def test_power_of_two_is_exact():
    e = torch.arange(-1022, 1024)
    assert torch.equal(power_of_two(e), torch.tensor([2.0 ** int(k) for k in e], dtype=torch.float64))


def test_fixed_point_product_is_the_exact_integer_sum():
    """The float64 GEMM of the rounded operands equals the sum done in int64, term by term."""
    torch.manual_seed(0)
    x = torch.randn(6, 1536) * torch.logspace(-4, 4, 1536)  # wide dynamic range within a row
    w = torch.randn(40, 1536)
    bits = operand_bits(1536)
    (xq, _), (wq, _) = to_fixed(x, bits), to_fixed(w, bits)
    assert xq.abs().max() <= 2 ** bits and wq.abs().max() <= 2 ** bits
    exact = torch.zeros(6, 40, dtype=torch.int64)
    for k in range(1536):
        exact += xq[:, k : k + 1].long() * wq[:, k].long()[None, :]
    assert torch.equal(xq @ wq.T, exact.double())


def test_fixed_point_linear_is_close_to_float64_and_depends_on_nothing_else():
    torch.manual_seed(1)
    w, b = torch.randn(300, 577), torch.randn(300)
    x = torch.randn(50, 577) * torch.logspace(-3, 3, 50)[:, None]
    linear = FixedPointLinear(w, b)
    y = linear(x)
    reference = x.double() @ w.double().T + b.double()
    bound = x.double().abs() @ w.double().abs().T * 2.0 ** -(operand_bits(577) - 1) + 2.0 ** -23 * reference.abs()
    assert ((y.double() - reference).abs() <= bound).all()
    for rows in (slice(0, 1), slice(7, 30), slice(49, 50)):
        assert torch.equal(linear(x[rows]), y[rows])  # a row's bits do not depend on its neighbours
    for threads in (1, 2, 4):
        with torch_threads(threads):
            assert torch.equal(linear(x), y)


def test_fixed_point_linear_keeps_the_last_roundings_of_its_weights_only():
    """The rounded weights of the last HELD_WEIGHTS maps that used theirs are kept (GPTQ's
    layer-by-layer forward reuses them), the older ones dropped; kept or recomputed, the same output."""
    from prism_backend.model.fixed_point import HELD_WEIGHTS

    torch.manual_seed(4)
    maps = [FixedPointLinear(torch.randn(16, 40)) for _ in range(HELD_WEIGHTS + 3)]
    x = torch.randn(5, 40)
    first = [m(x) for m in maps]
    held = [m._held is not None for m in maps]
    assert held == [False] * 3 + [True] * HELD_WEIGHTS
    assert all(torch.equal(m(x), y) for m, y in zip(maps, first))  # the dropped ones round again
    assert all(torch.equal(m(x), FixedPointLinear(m.weight)(x)) for m in maps)


def test_hessian_is_exact_whatever_the_row_order_and_thread_count():
    """Rows with the same power of two are summed exactly, so permuting them (another dgemm order)
    or another thread count changes no bit; and H is x^T x to float64 rounding of 20-bit inputs."""
    torch.manual_seed(2)
    x = torch.randn(3000, 96) * torch.rand(3000, 1)  # per-row scales: several powers of two
    h = Hessian(96)
    h.add(x)
    _, e = to_fixed(x, 20)
    assert len(torch.unique(e)) > 3
    order = torch.argsort(e[:, 0] * 100000 + torch.randperm(3000), stable=True)  # rows shuffled within each power
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            again = Hessian(96)
            again.add(x[order])
        assert torch.equal(again.h, h.h)
    reference = x.double().T @ x.double()
    assert torch.allclose(h.h, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_calibration_forward_has_no_float_product(monkeypatch, model_dir):
    """Every projection of the calibration forwards is a FixedPointLinear: a float32 F.linear
    anywhere in them would make the statistics depend on the CPU's BLAS."""
    import torch.nn.functional as F

    from prism_backend.engine import calibration
    from prism_backend.model.loader import load_model

    calls = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: calls.append(a[0].shape) or real_linear(*a, **k))
    spec, weights = load_model(model_dir)
    forest = calibration.build_forest(calibration.calibration_requests(calibration.load_tokenizer(model_dir))[:1],
                                      block_tokens=spec.max_context)
    model = calibration._replayable(calibration.ForestTransformer(spec, weights))
    model.answer_hidden(forest)
    assert calls == []


def calibration_digests(config) -> dict[str, str]:
    """sha256 of GPTQ's integers, scales and bias corrections (every layer, every projection) and of
    SmoothQuant's maxima."""
    from prism_backend.engine import calibration

    integers, maxima = hashlib.sha256(), hashlib.sha256()
    for layer in calibration.gptq_integers(config):
        for name in sorted(layer):
            q, scale, correction = layer[name]
            integers.update(name.encode() + q.to(torch.int8).contiguous().numpy().tobytes() + scale.numpy().tobytes()
                            + correction.numpy().tobytes())
    for layer in calibration.calibration_stats(config):
        for name in sorted(layer):
            maxima.update(name.encode() + layer[name].contiguous().numpy().tobytes())
    return {"gptq_integers": integers.hexdigest(), "smoothing_maxima": maxima.hexdigest()}


def test_the_calibration_matches_the_golden_digests(fp32_config):
    """GPTQ's integers and corrections (all of them, also those the plan keeps exact) and the smoothing
    maxima: the same on every run and every machine."""
    golden = json.loads(GOLDEN_DECISIONS_PATH.read_text())
    assert calibration_digests(fp32_config) == {k: golden[k] for k in ("gptq_integers", "smoothing_maxima")}


def test_the_default_decisions_match_the_golden_digests(int8_pipeline):
    golden = json.loads(GOLDEN_DECISIONS_PATH.read_text())
    assert int8_pipeline.engine.config.keep_exact == golden["keep_exact"]
    assert decision_digests(int8_pipeline) == golden["int8"]


def test_qkv_rotates_in_its_epilogue_where_it_can_with_the_bits_of_the_separate_pass(int8_pipeline, monkeypatch):
    """Where qkv's route is a VNNI tile (vnni16 for the default on AVX-512 VNNI, vnni8 on the 8-bit
    rung) the decoder asks it for q and k already rotated and gives attention the queries in place;
    elsewhere (AVX2's int16, AMX, the GPU) the rotary pass runs after it. Forcing that pass here gives
    the same decisions to the bit."""
    from prism_backend.model.transformer import ForestTransformer

    model = int8_pipeline.engine.model
    assert model._rotary_in_qkv(model.w.layers[0], model.proj[0]) == (model.proj[0].qkv.w.route in ("vnni8", "vnni16"))
    fused = decision_digests(int8_pipeline)
    monkeypatch.setattr(ForestTransformer, "_rotary_in_qkv", lambda self, lw, p: False)
    assert decision_digests(int8_pipeline) == fused


def test_the_exact_decisions_match_the_golden_digests(fp32_config):
    from prism_backend.serving.pipeline import DecisionPipeline
    from helpers import REGISTRY

    golden = json.loads(GOLDEN_DECISIONS_PATH.read_text())
    assert decision_digests(DecisionPipeline(fp32_config.replace(precision="exact"), REGISTRY)) == golden["exact"]


def _write_golden() -> None:
    """Recompute the committed digests on this machine (both precisions, the default config)."""
    from kernels.cpu.features import machine
    from prism_backend.config import EngineConfig
    from prism_backend.paths import DEFAULT_MODEL_DIR
    from prism_backend.serving.pipeline import DecisionPipeline
    from helpers import REGISTRY

    config = EngineConfig(model_dir=DEFAULT_MODEL_DIR, prefix_cache_bytes=0)
    out = {"made_on": machine(), "keep_exact": config.keep_exact, **calibration_digests(config)}
    for precision in ("int8", "exact"):
        out[precision] = decision_digests(DecisionPipeline(config.replace(precision=precision), REGISTRY))
    GOLDEN_DECISIONS_PATH.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(_write_golden())
