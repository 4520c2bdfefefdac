"""A decoder layer in one call into the kernel library (kernels/cpu/decoder_layer.py) gives the bits of
the Python pipeline's steps (prism_backend/model/transformer.py ForestTransformer._layer): the served
default and the 8-bit rung, every row and the K/V kept, with earlier rows' K/V (prefill chunks and
cached prefixes), at 1-4 threads and for a forest alone or packed with others."""
import pytest
import torch

from kernels.cpu import decoder_layer
from kernels.cpu.exact_gemm import PackedWeight, PackedWeight8
from kernels.cpu.features import has_avx512_vnni
from prism_backend.engine.forest_builder import build_forest
from prism_backend.model import exact_matmul
from prism_backend.reproducibility import torch_threads

from helpers import REGISTRY, SAMPLE_TICKET

pytestmark = pytest.mark.skipif(not has_avx512_vnni(), reason="the one-call layer runs the VNNI kernels")

OTHER_TICKET = "Since this morning the export to CSV fails with error 500 for every report older than a month."


def _vnni_route(act_passes: int = 2, weight_passes: int = 2, shape=(576, 1536)) -> str:
    """The VNNI kernel for these integers: which route the timing picks can vary on a busy machine
    (torch._int_mm's digits keep a layer on the Python steps), so these tests choose it."""
    return "vnni8" if exact_matmul.int_bound(act_passes) <= 127 and exact_matmul.int_bound(weight_passes) <= 127 \
        else "vnni16"


@pytest.fixture(scope="module")
def pipelines(fp32_config):
    """{"default": the int8 default, "rung": every projection 8-bit}, every projection on a VNNI kernel."""
    from prism_backend.serving.pipeline import DecisionPipeline

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exact_matmul, "route", _vnni_route)
        default = DecisionPipeline(fp32_config.replace(precision="int8"), REGISTRY)
        rung = DecisionPipeline(fp32_config.replace(precision="int8", keep_exact=""), REGISTRY)
    yield {"default": default, "rung": rung}
    for pipeline in (default, rung):
        pipeline.engine.close()


def _run(model, forest, chunks, one_call: bool):
    """model.run over the forest's segments in `chunks`, each given the K/V of the ones before ->
    (every chunk's answer states, the last chunk's K/V per layer)."""
    model.one_call_layers = one_call
    try:
        hidden, past = [], None
        for chunk in chunks:
            h, past = model.run(forest, chunk, past, keep_kv=True)
            hidden.append(h)
        return hidden, past
    finally:
        model.one_call_layers = True


def _forest(pipeline, tickets):
    return build_forest([pipeline.frontend.encode(t, ["team", "reply_time", "severity"])[0] for t in tickets])


def _assert_same(got, expected):
    (hidden, kv), (hidden_ref, kv_ref) = got, expected
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_ref, strict=True))
    assert all(torch.equal(k, k_ref) and torch.equal(v, v_ref) for (k, v), (k_ref, v_ref) in zip(kv, kv_ref, strict=True))


@pytest.mark.parametrize("plan", ["default", "rung"])
def test_the_one_call_layer_runs_every_full_layer_on_vnni_kernels(pipelines, plan):
    model = pipelines[plan].engine.model
    layers = [model._one_call_layer(i) for i in range(len(model.proj) - 1)]
    assert all(isinstance(layer, decoder_layer.DecoderLayer) for layer in layers)
    assert model._one_call_layer(0) is layers[0]  # built once, kept while the projections stay
    kinds = {type(getattr(p, name).w.fused) for p in model.proj[:-1] for name in ("qkv", "o", "gate_up", "down")}
    assert kinds == ({PackedWeight8} if plan == "rung" else {PackedWeight8, PackedWeight})


def test_a_swapped_projection_sends_its_layer_to_the_python_steps(pipelines):
    """Calibration and the benches wrap projections: such a layer runs step by step, and its one-call
    form comes back with the projection."""
    model = pipelines["default"].engine.model
    served = model.proj[2].o
    model.proj[2].o = lambda x, residual=None, prologue=None: served(x, residual=residual, prologue=prologue)
    try:
        assert model._one_call_layer(2) is None and model._one_call_layer(1) is not None
    finally:
        model.proj[2].o = served
    assert isinstance(model._one_call_layer(2), decoder_layer.DecoderLayer)


@pytest.mark.parametrize("plan", ["default", "rung"])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_the_one_call_layer_gives_the_python_pipelines_bits(pipelines, plan, threads, monkeypatch):
    pipeline = pipelines[plan]
    model = pipeline.engine.model
    forest = _forest(pipeline, [SAMPLE_TICKET, OTHER_TICKET])
    segments = list(range(len(forest.segments)))
    with torch_threads(threads):
        expected = _run(model, forest, [segments], one_call=False)
        calls = []
        monkeypatch.setattr(type(model), "_layer", lambda *a: calls.append(a))  # a Python layer would fail
        got = _run(model, forest, [segments], one_call=True)
    assert not calls
    _assert_same(got, expected)
    assert expected[0][0].shape[0] == 6 and not expected[0][0].isnan().any()


def test_the_one_call_layer_takes_earlier_rows_kv_as_the_python_pipeline_does(pipelines):
    """Prefill chunks: the root and trunk first, the branches given their K/V after (a cached prefix
    reaches run() the same way)."""
    pipeline = pipelines["default"]
    model = pipeline.engine.model
    forest = _forest(pipeline, [SAMPLE_TICKET])
    branches = [i for i, s in enumerate(forest.segments) if s.is_branch]
    first = [i for i in range(len(forest.segments)) if i < branches[0]]
    chunks = [first, list(range(branches[0], len(forest.segments)))]
    expected = _run(model, forest, chunks, one_call=False)
    _assert_same(_run(model, forest, chunks, one_call=True), expected)
    whole = _run(model, forest, [first + chunks[1]], one_call=True)
    assert torch.equal(torch.cat(expected[0]), whole[0][0])  # and chunking moves no bit


def test_the_one_call_layer_refuses_weights_it_has_no_kernel_for():
    w = torch.zeros(64, 3 * 64)
    vnni, avx2 = PackedWeight(w, 127, vnni=True), PackedWeight(w, 127)

    def projection(packed, n):
        return decoder_layer.Projection(packed, 127, torch.ones(n), None)

    o = decoder_layer.Projection(PackedWeight(torch.zeros(64, 64), 127, vnni=True), 127, torch.ones(64), None)
    gate_up = decoder_layer.Projection(PackedWeight8(torch.zeros(64, 256), glu=True), 127, torch.ones(256), None)
    down = decoder_layer.Projection(PackedWeight8(torch.zeros(128, 64)), 127, torch.ones(64), None)
    norm = torch.ones(64)
    layer = decoder_layer.DecoderLayer(projection(vnni, 192), o, gate_up, down, norm, norm, 1e-5, 1, 1)
    assert layer.act_columns == 128  # SwiGLU in gate_up's tile
    assert layer.operand_bytes == 128  # the widest operand row: down's 128 columns of uint8, qkv's 64 of int16
    with pytest.raises(ValueError, match="qkv: a VNNI kernel's"):
        decoder_layer.DecoderLayer(projection(avx2, 192), o, gate_up, down, norm, norm, 1e-5, 1, 1)
    with pytest.raises(ValueError, match="qkv: a VNNI kernel's \\(64, 256\\)"):  # two query heads: other shapes
        decoder_layer.DecoderLayer(projection(vnni, 192), o, gate_up, down, norm, norm, 1e-5, 2, 1)
    with pytest.raises(ValueError, match="Hadamard block"):
        decoder_layer.DecoderLayer(projection(vnni, 192), o, gate_up, down, norm, norm, 1e-5, 1, 1, down_block=48)
