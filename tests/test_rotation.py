"""The int8 precision's model changes: Hadamard matrices, the rotated model (the same fp32 function),
the online Hadamard (batch- and thread-invariant), GPTQ (reproducible, better than rounding to
nearest) and the precision plan."""
import numpy as np
import pytest
import torch

from prism_backend.config import ConfigError, EngineConfig
from prism_backend.engine import calibration
from prism_backend.engine.forest_builder import build_forest
from prism_backend.model import hadamard, rotation
from prism_backend.model.gptq import gptq
from prism_backend.model.loader import load_model
from prism_backend.model.rotation import down_block, online_down, rotate
from prism_backend.model.transformer import ForestTransformer
from prism_backend.reproducibility import torch_threads

from helpers import TINY_ARCHS, needs


@pytest.mark.parametrize("n", [2, 12, 20, 64, 576, 1536, 896])
def test_hadamard_matrices_are_hadamard(n):
    h = hadamard.matrix(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_hadamard_orders():
    assert hadamard.factors(576) == (12, 12, 2, 2) and hadamard.factors(1536) == (12,) + (2,) * 7
    assert hadamard.factors(18944) is None and hadamard.factors(6) is None
    with pytest.raises(ValueError, match="Paley"):
        hadamard.paley(16)


def test_transform_is_the_matrix_product_and_blockwise():
    x = torch.randn(5, 576, dtype=torch.float64)
    torch.testing.assert_close(hadamard.transform(x), x @ hadamard.matrix(576), rtol=1e-12, atol=1e-10)
    y = torch.randn(3, 256, dtype=torch.float64)
    block = torch.block_diag(hadamard.matrix(128), hadamard.matrix(128))
    torch.testing.assert_close(hadamard.transform(y, 128), y @ block, rtol=1e-12, atol=1e-10)


def _transform_one_sum_at_a_time(x: torch.Tensor, order: int) -> torch.Tensor:
    """x (R, n) -> x H (blocks of `order`) written out: every output a chain of sums and differences of
    its inputs in index order, one factor of H at a time -- what hadamard.transform must equal bit
    for bit (it vectorises and chunks the same additions)."""
    y = x.reshape(x.shape[0], -1, *hadamard.factors(order))
    for axis, f in enumerate(hadamard.factors(order), start=2):
        h = hadamard.paley(f) if f > 2 else torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        parts = y.unbind(axis)
        out = []
        for j in range(f):
            acc = parts[0] if h[0, j] > 0 else -parts[0]
            for i in range(1, f):
                acc = acc + parts[i] if h[i, j] > 0 else acc - parts[i]
            out.append(acc)
        y = torch.stack(out, dim=axis)
    return y.reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, n, block", [(3, 576, None), (300, 576, None), (700, 1536, 128), (5, 1536, 1536), (129, 40, 20)])
def test_transform_is_the_written_out_sums(dtype, rows, n, block):
    torch.manual_seed(rows + n)
    x = torch.randn(rows, n, dtype=dtype) * torch.logspace(-3, 3, n, dtype=dtype)  # mixed magnitudes: rounding shows
    x[0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int64  # compares signed zeros too
    got, want = hadamard.transform(x, block), _transform_one_sum_at_a_time(x, block or n)
    assert torch.equal(got.view(bits), want.view(bits))


def test_online_hadamard_is_batch_and_thread_invariant():
    """A row's bits are the same alone, in runs of 7 or in one batch, on 1 or 2 threads."""
    x = torch.randn(301, 1536)
    with torch_threads(2):
        batched = online_down(x, 128)
    with torch_threads(1):
        single = torch.cat([online_down(x[i : i + 1], 128) for i in range(301)])
        runs = torch.cat([online_down(x[i : i + 7], 128) for i in range(0, 301, 7)])
    assert torch.equal(batched, single) and torch.equal(batched, runs)


@needs("avx2")
@pytest.mark.parametrize("shape,block", [((301, 1536), 128), ((5, 96), 32), ((1, 256), 2), ((2, 12), 4), ((3, 64), 8),
                                         ((7, 48), 16), ((3, 192), 64), ((4, 1024), 512), ((3, 768), 256),
                                         ((2, 2048), 1024)])
def test_the_kernel_butterfly_equals_the_torch_one(shape, block):
    """online_down's CPU kernel (kernels/cpu/csrc/rowwise.cpp) and hadamard.transform: the same bits, in
    8 pairs per instruction and, where the CPU has AVX-512, in 16 (the last four stages in a register)."""
    from kernels.cpu import rowwise
    from kernels.cpu.features import has_avx512

    x = torch.randn(shape) * 7
    with torch_threads(2):
        for wide in (False, True) if has_avx512() else (False,):
            assert torch.equal(rowwise.hadamard_rows(x, block, wide=wide), hadamard.transform(x, block)), wide
    with torch_threads(1):
        assert torch.equal(online_down(x, block), hadamard.transform(x, block))


def logits(model_dir, rotated: bool, requests=3):
    """Candidate logits of the first calibration requests: (A, C) from the fp32 model."""
    from prism_backend.text.tokenizer import load_tokenizer

    reqs = calibration.calibration_requests(load_tokenizer(model_dir))[:requests]
    forest = build_forest(reqs)
    spec, weights = load_model(model_dir)
    if rotated:
        rotate(spec, weights)
    hidden = ForestTransformer(spec, weights).answer_hidden(forest)  # (A, H)
    return hidden @ weights.lm_head[:64].T, weights


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_rotated_fp32_model_is_the_same_function_tiny(tiny_model_dir, arch):
    before, _ = logits(tiny_model_dir(arch), rotated=False)
    after, weights = logits(tiny_model_dir(arch), rotated=True)
    assert weights.down_block == down_block(96) == 32 and weights.lm_head.data_ptr() != weights.embed.data_ptr()
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_rotated_fp32_model_is_the_same_function_embedded(model_dir):
    """SmolLM2: hidden 576 = H12 x H12 x H4 with signs, per-head H64, down's H128 blocks online;
    the logits of real prompts agree to float32 rounding."""
    before, _ = logits(model_dir, rotated=False)
    after, weights = logits(model_dir, rotated=True)
    assert weights.down_block == 128 and torch.equal(weights.final_norm, torch.ones(576))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=2e-4)


def test_rotated_weights_are_reproducible(tiny_model_dir):
    a, b = (load_model(tiny_model_dir("qwen2"))[1] for _ in range(2))
    spec = load_model(tiny_model_dir("qwen2"))[0]
    with torch_threads(1):
        rotate(spec, a)
    with torch_threads(2):
        rotate(spec, b)
    assert all(torch.equal(x.wqkv, y.wqkv) and torch.equal(x.bqkv, y.bqkv) and torch.equal(x.w_down, y.w_down)
               for x, y in zip(a.layers, b.layers))


def test_rotation_runs_on_one_thread_and_gives_the_pool_back(tiny_model_dir, monkeypatch):
    """Element-wise passes on one thread (two threads on busy cores wait for each other at every
    pass); the caller's thread count is restored."""
    seen = []
    transform = rotation._transform  # hadamard.transform, or the kernel library's copy of it
    monkeypatch.setattr(rotation, "_transform", lambda *a, **k: seen.append(torch.get_num_threads()) or transform(*a, **k))
    spec, weights = load_model(tiny_model_dir("llama_tied"))
    with torch_threads(2):
        rotate(spec, weights)
        assert torch.get_num_threads() == 2
    assert seen and set(seen) == {1}


def test_gptq_beats_round_to_nearest_on_the_inputs_it_saw():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(2000, 64, generator=g) @ mix  # correlated inputs, as activations are
    w = torch.randn(48, 64, generator=g)
    h = x.double().T @ x.double()
    q, scale = gptq(w, h)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    rtn = torch.round(w / scale[:, None]).clamp(-127, 127)

    def error(ints):
        return (x @ (w - ints * scale[:, None]).T).norm()

    assert error(q) < 0.8 * error(rtn)
    q2, scale2 = gptq(w, h)
    assert torch.equal(q, q2) and torch.equal(scale, scale2)


def test_gptq_integers_are_reproducible(tiny_model_dir, monkeypatch):
    """The integers the engine serves: computed twice with the cache off, the same -- once with the
    calibration forwards on 2 threads and two matrices quantised at once, once all on 1 thread."""
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", "off")
    config = EngineConfig(model_dir=tiny_model_dir("llama3"))
    with torch_threads(2):
        a = calibration.gptq_integers(config)
    with torch_threads(1):
        b = calibration.gptq_integers(config)
    assert len(a) == 2 and set(a[0]) == {"qkv", "o", "gate_up", "down"}
    for x, y in zip(a, b):
        for name in x:
            assert len(x[name]) == 3 and all(torch.equal(u, v) for u, v in zip(x[name], y[name]))  # integers, scales, corrections
            assert x[name][0].dtype == torch.int8
            assert x[name][2].shape == x[name][1].shape and x[name][2].dtype == torch.float32


def test_bias_correction_zeroes_the_mean_error_on_the_calibration_rows(tiny_model_dir, monkeypatch):
    """Served with its correction as a bias, each 8-bit projection's mean output error over the
    calibration rows (fp32 model's inputs) is zero up to float32 rounding; without it, it is not."""
    from prism_backend.model.gptq import measure_corrections
    from prism_backend.text.tokenizer import load_tokenizer

    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", "off")
    config = EngineConfig(model_dir=tiny_model_dir("llama3"))
    corrected = calibration.gptq_integers(config)
    plain = [{name: ints[:2] for name, ints in layer.items()} for layer in corrected]
    spec, weights = load_model(config.model_dir)
    rotate(spec, weights)
    forests = [build_forest([r], block_tokens=spec.max_context)
               for r in calibration.gptq_requests(load_tokenizer(config.model_dir), spec.max_context)]
    model = calibration._replayable(ForestTransformer(spec, weights, every_row=True))
    with torch_threads(1):
        residual = measure_corrections(model, forests, corrected)
        uncorrected = measure_corrections(model, forests, plain)
    for layer, before, after in zip(corrected, uncorrected, residual):
        for name in layer:
            assert torch.equal(before[name], layer[name][2])  # what the calibration stored
            assert before[name].abs().max() > 0
            assert after[name].abs().max() < 0.01 * before[name].abs().max(), name


def test_the_plan_keeps_the_named_projections_exact(tiny_model_dir):
    from prism_backend.engine.engine import DecisionEngine

    engine = DecisionEngine(EngineConfig(model_dir=tiny_model_dir("llama3"), keep_exact="down@1, o",
                                         prefix_cache_bytes=0))
    passes = [{name: getattr(p, name).weight_passes for name in ("o", "gate_up", "down")} for p in engine.model.proj]
    assert passes == [{"o": 2, "gate_up": 1, "down": 1}, {"o": 2, "gate_up": 1, "down": 2}]
    assert engine.model.proj[0].qkv.act_passes == 1 and engine.model.proj[1].q.act_passes == 1


def test_a_plan_item_serves_its_own_passes(tiny_model_dir):
    """`down:1+2` serves down_proj as 8-bit activations on 13-bit weights (round-to-nearest), qkv in the
    settings' 2+2: the projection's output is bit for bit quant.py's integers of that width, multiplied
    exactly and dequantised -- which 13-bit activations would not give."""
    from prism_backend.engine.engine import DecisionEngine
    from prism_backend.model.exact_matmul import dequantize, quantize_rows

    engine = DecisionEngine(EngineConfig(model_dir=tiny_model_dir("llama3"), keep_exact="qkv, down:1+2",
                                         prefix_cache_bytes=0))
    first, last = engine.model.proj
    for p in (first, last):
        assert (p.down.act_passes, p.down.weight_passes) == (1, 2)
        assert (p.gate_up.act_passes, p.gate_up.weight_passes) == (1, 1)  # GPTQ's 8 bits
    assert (first.qkv.act_passes, first.qkv.weight_passes) == (2, 2) == (last.q.act_passes, last.kv.weight_passes)
    down = first.down
    high, low = down.w.int8_digits()  # (I, H) int8 each
    w_int = high.double() * 128 + low.double()
    assert 127 < w_int.abs().max() <= 8191
    x = torch.randn(7, w_int.shape[0], generator=torch.Generator().manual_seed(3))
    served = down(x)
    for bound, equal in ((127, True), (8191, False)):
        x_int, x_scale = quantize_rows(x, bound)
        expected = dequantize(torch.mm(x_int.double(), w_int), x_scale, down.w_scale, None)
        assert torch.equal(served, expected) == equal


def test_a_plan_item_names_passes_once(tmp_path):
    plan = EngineConfig(model_dir=tmp_path, keep_exact="qkv@0-1:1+2, qkv@2, down:1+2")
    assert plan.exact_plan == (("qkv", 0), ("qkv", 1), ("qkv", 2), ("down", None))
    assert [plan.exact_passes("qkv", layer) for layer in range(4)] == [(1, 2), (1, 2), (2, 2), None]
    assert plan.exact_passes("down", 7) == (1, 2) and plan.exact_passes("o", 0) is None
    assert EngineConfig.from_parameters({"model_dir": str(tmp_path), "keep_exact": "down:3+2"}).exact_passes(
        "down", 0) == (3, 2)
    for bad, message in (("down, down@3:1+2", "down of layer 3 with different passes: 1\\+2, 2\\+2"),
                         ("down:1+2, down", "down of every layer with different passes"),
                         ("down:1+1", "1\\+1 passes, the projection's 8-bit form"),
                         ("down:4+2", "'down:4\\+2': act_passes must be 1, 2 or 3"),
                         ("down:2+3", "weight_passes must be 1 or 2"), ("down:1-2", "not a projection")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(model_dir=tmp_path, keep_exact=bad)


def test_the_old_8_bit_rung_names_the_new_precisions(tmp_path):
    with pytest.raises(ConfigError, match="precision 'exact' with act_passes=1"):
        EngineConfig(model_dir=tmp_path, precision="int8", act_passes=1, weight_passes=1)
    EngineConfig(model_dir=tmp_path, precision="exact", act_passes=1, weight_passes=1)


def test_the_default_plan_keeps_down_and_qkv_exact_and_an_empty_parameter_keeps_nothing(tmp_path):
    """The default plan is the one the full eval measured better than bf16 (docs/eval.md); the
    parameter set to "" (`prism serve --parameter keep_exact=`) is every projection in 8 bits."""
    default = EngineConfig(model_dir=tmp_path)
    assert default.precision == "int8" and default.exact_plan == (("down", None), ("qkv", None))
    assert all(default.keeps_exact("down", layer) and default.keeps_exact("qkv", layer)
               and not default.keeps_exact("o", layer) and not default.keeps_exact("gate_up", layer) for layer in range(30))
    everything_8bit = EngineConfig.from_parameters({"model_dir": str(tmp_path), "keep_exact": ""})
    assert everything_8bit.exact_plan == () and not everything_8bit.keeps_exact("down", 0)


def test_a_plan_names_layer_ranges_both_ends_included(tmp_path):
    plan = EngineConfig(model_dir=tmp_path, keep_exact="qkv@0-2, down@5")
    assert plan.exact_plan == (("qkv", 0), ("qkv", 1), ("qkv", 2), ("down", 5))
    assert [layer for layer in range(8) if plan.keeps_exact("qkv", layer)] == [0, 1, 2]
    assert [layer for layer in range(8) if plan.keeps_exact("down", layer)] == [5]


@pytest.mark.parametrize("bad", ["mlp", "down@x", "down@", "down@3-1", "down@1-", "down@-2", "down@1-x"])
def test_a_bad_plan_is_rejected(tmp_path, bad):
    with pytest.raises(ConfigError, match="keep_exact"):
        EngineConfig(model_dir=tmp_path, keep_exact=bad)


def test_int8_is_closer_to_fp32_than_plain_w8a8(pipeline, int8_pipeline):
    """On the sample tickets: the rotated GPTQ default vs the unrotated round-to-nearest 8-bit rung
    (the exact scheme with one pass a side)."""
    from prism_backend.serving.pipeline import DecisionPipeline

    from helpers import REGISTRY, SAMPLE_TICKET

    plain = DecisionPipeline(pipeline.engine.config.replace(precision="exact", act_passes=1, weight_passes=1), REGISTRY)
    tasks = ["team", "reply_time", "severity"]

    def probs(p):
        return np.concatenate([list(d["probabilities"].values()) for d in p.decide(SAMPLE_TICKET, tasks)])

    reference = probs(pipeline)
    assert np.abs(probs(int8_pipeline) - reference).mean() < np.abs(probs(plain) - reference).mean()
