"""The calibration cache (prism_backend/engine/calibration.py): a stored copy is what the
computation gives, bit for bit; a changed checkpoint or a damaged file is calibrated again; a cache
that cannot be written only costs time."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from prism_backend.config import EngineConfig
from prism_backend.engine import calibration
from prism_backend.engine.engine import DecisionEngine
from prism_backend.serving.determinism import synthetic_requests


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "calibration"
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(folder))
    return folder


@pytest.fixture
def calibrations(monkeypatch):
    """Counts the calibrations that really run: SmoothQuant's forward (exact) and GPTQ's (int8)."""
    calls = []
    for name in ("_calibrate", "_gptq"):
        real = getattr(calibration, name)

        def counted(*args, real=real):
            calls.append(args[0].model_dir)
            return real(*args)

        monkeypatch.setattr(calibration, name, counted)
    return calls


def stats_of(model_dir):
    return calibration.calibration_stats(EngineConfig(model_dir=model_dir, precision="exact"))


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_stored_statistics_are_the_computed_ones(model_dir, cache, calibrations, monkeypatch):
    """The embedded model: cold computes and stores, warm reads without a forward, and what it reads
    equals a computation with the cache off."""
    cold = stats_of(model_dir)
    assert len(calibrations) == 1 and len(list(cache.glob("*.safetensors"))) == 1
    warm = stats_of(model_dir)
    assert len(calibrations) == 1 and same(warm, cold)
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", "off")
    assert same(stats_of(model_dir), warm) and len(calibrations) == 2


@pytest.mark.parametrize("precision", ["int8", "exact"])
def test_cold_and_warm_engines_give_the_same_bits(tiny_model_dir, cache, calibrations, precision):
    """Both calibrations: int8's GPTQ integers and exact's SmoothQuant statistics."""
    config = EngineConfig(model_dir=tiny_model_dir("qwen3"), precision=precision, prefix_cache_bytes=0)
    cold = DecisionEngine(config)
    warm = DecisionEngine(config)
    assert len(calibrations) == 1
    requests = synthetic_requests(cold.spec.vocab_size)

    def bits(engine):
        return [[s.probabilities.tobytes() for s in r] for r in engine.score(requests)[0]]

    assert bits(warm) == bits(cold)


def test_a_changed_checkpoint_is_calibrated_again(tiny_model_dir, tmp_path, cache, calibrations):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama_tied"), model)
    stats_of(model)
    stats_of(model)
    assert len(calibrations) == 1
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten in place
    stats_of(model)
    assert len(calibrations) == 2
    config = model / "config.json"
    edited = config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    assert edited != config.read_text()
    config.write_text(edited)
    stats_of(model)
    assert len(calibrations) == 3
    template = model / "chat_template.jinja"  # the calibration prompts' tokens follow the tokenizer's files
    template.write_text(template.read_text().replace("<|im_start|>system", "<|im_start|>system "))
    stats_of(model)
    assert len(calibrations) == 4
    assert len(list(cache.glob("*.safetensors"))) == 4  # one file per key; stale ones are simply never read


def test_a_damaged_file_is_replaced(tiny_model_dir, cache, calibrations):
    model = tiny_model_dir("mistral")
    good = stats_of(model)
    (stored,) = cache.glob("*.safetensors")
    stored.write_bytes(stored.read_bytes()[:100])  # e.g. a disk that filled up under another writer
    assert calibration.load(calibration.entry(model)) is None
    assert same(stats_of(model), good) and len(calibrations) == 2
    assert same(calibration.load(calibration.entry(model)), good)


def test_builds_that_miss_together_calibrate_once(tiny_model_dir, cache, calibrations):
    """A build that misses while another one computes the same entry waits for it, then loads the
    other's file instead of computing it a second time beside it."""
    import threading

    config = EngineConfig(model_dir=tiny_model_dir("llama3"))
    stored = calibration.entry(config.model_dir, calibration.GPTQ)
    got = []
    with calibration.one_at_a_time(stored):  # this test is the build computing it now
        waiting = threading.Thread(target=lambda: got.append(calibration.gptq_integers(config)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not got  # it waits for the entry
        first = calibration._integers_to_tensors(calibration._gptq(config))
        calibration.store(stored, first, raw=True)
    waiting.join(120)
    assert not waiting.is_alive() and len(calibrations) == 1  # only this test's own computation
    expected = calibration._integers_from_tensors(first)
    assert len(got[0]) == len(expected)
    for layer, want in zip(got[0], expected):
        assert layer.keys() == want.keys()
        assert all(torch.equal(a, b) for name in layer for a, b in zip(layer[name], want[name]))


def test_an_unwritable_cache_only_costs_time(tiny_model_dir, tmp_path, monkeypatch, calibrations):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(blocker / "calibration"))
    model = tiny_model_dir("qwen2")
    first = stats_of(model)
    assert same(stats_of(model), first) and len(calibrations) == 2


def test_an_edited_kernel_source_changes_the_key(tiny_model_dir, tmp_path, monkeypatch):
    """The calibration forward runs Prism's CPU kernels: an edit to their C++ (or Python) must miss
    the cache, as an edit to the engine does."""
    from kernels.cpu import exact_gemm
    from prism_backend.model import kernel_sources

    kernels = tmp_path / "kernels"
    shutil.copytree(kernel_sources.KERNELS_ROOT, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernel_sources, "KERNELS_ROOT", kernels)
    monkeypatch.setattr(exact_gemm, "CSRC", kernels / "cpu" / "csrc")
    model_dir = tiny_model_dir("llama_tied")
    before = calibration.cache_key(model_dir)
    assert calibration.cache_key(model_dir) == before
    source = next((kernels / "cpu" / "csrc").glob("*.cpp"))
    source.write_text(source.read_text() + "\n// edited\n")
    edited = calibration.cache_key(model_dir)
    assert edited != before
    python = kernels / "cpu" / "rowwise.py"
    python.write_text(python.read_text() + "\n# edited\n")
    assert calibration.cache_key(model_dir) not in (before, edited)


def mapped_spans(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path`."""
    with open("/proc/self/maps") as maps:
        return [tuple(int(x, 16) for x in line.split()[0].split("-"))
                for line in maps if line.rstrip().endswith(str(path))]


def test_the_rotated_embedding_and_head_are_mapped_from_the_cache(tiny_model_dir, cache, monkeypatch):
    """int8 (rotated): the embedding and the LM head are views of the cache's stored copy, mapped
    rather than held in memory, and a second engine maps the same file; with the cache off they
    stay in memory. The same bits every way."""
    from prism_backend.engine import runner
    from prism_backend.model import rotation

    config = EngineConfig(model_dir=tiny_model_dir("llama_tied"), prefix_cache_bytes=0)
    made = []
    compute = rotation.rotated_vocab
    for module in (runner, rotation):  # the runner's build and GPTQ's calibration forward (calibration._gptq)
        monkeypatch.setattr(module, "rotated_vocab", lambda *args: made.append(1) or compute(*args))
    mapped = DecisionEngine(config)
    assert made == [1]  # a cold build rotates the vocabulary once: GPTQ stores it, the runner maps it
    again = DecisionEngine(config)
    assert made == [1]  # a warm build maps the stored rows without rotating the vocabulary again
    (rows_file,) = cache.glob("*-rows.safetensors")
    spans = mapped_spans(rows_file)

    def in_file(t):
        return any(start <= t.data_ptr() < end for start, end in spans)

    assert all(in_file(t) for e in (mapped, again) for t in (e.runner.model.w.embed, e.lm_head))
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", "off")
    in_memory = DecisionEngine(config)
    assert not any(in_file(t) for t in (in_memory.runner.model.w.embed, in_memory.lm_head))
    requests = synthetic_requests(mapped.spec.vocab_size)

    def bits(engine):
        return [[s.probabilities.tobytes() for s in r] for r in engine.score(requests)[0]]

    assert bits(mapped) == bits(in_memory) == bits(again)


def test_the_routes_timed_during_calibration_are_forgotten(monkeypatch, fp32_config):
    """The int8 calibration's 8-bit projections time their exact routes while GPTQ's worker threads
    wind down; those choices must not become the served model's (exact_matmul.timings_forgotten),
    while routes chosen before it stay."""
    from prism_backend.model import exact_matmul, gptq

    timed = []

    def quantize(model, forests, workers):  # GPTQ's forward, reduced to a projection timing its route
        timed.append(exact_matmul.route(1, 1, (64, 32)))
        return []

    monkeypatch.setattr(gptq, "quantize_layer_by_layer", quantize)
    monkeypatch.setattr(exact_matmul, "_fastest", {(2, 2, 576, 960): "int16"})
    calibration._gptq(fp32_config.replace(precision="int8"))
    assert timed and exact_matmul.chosen_routes() == {(2, 2, 576, 960): "int16"}
    with exact_matmul.timings_forgotten():
        exact_matmul.route(1, 1, (64, 32))
        assert (1, 1, 64, 32) in exact_matmul.chosen_routes()
    assert exact_matmul.chosen_routes() == {(2, 2, 576, 960): "int16"}


def shipped_files(model):
    return sorted(p.name for p in (model / calibration.SHIPPED).iterdir())


@pytest.mark.parametrize("precision", ["int8", "exact"])
def test_a_shipped_calibration_is_read_instead_of_calibrating(tiny_model_dir, tmp_path, monkeypatch,
                                                              calibrations, precision):
    """ship() (prism export-repository) puts the calibration beside the weights; a machine with an
    empty cache then builds the same engine without calibrating and without writing to its cache --
    also from a copy that did not keep the files' times (checked by sha256) -- and says so."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen2"), model)
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path / "exporter-cache"))
    config = EngineConfig(model_dir=model, precision=precision, prefix_cache_bytes=0)
    written = calibration.ship(config)
    assert len(calibrations) == 1
    kinds = calibration.needed(config, quantized=False)
    assert shipped_files(model) == sorted([calibration.SHIPPED_MANIFEST] + [calibration.SHIPPED_FILES[k] for k in kinds])
    assert sorted(p.name for p in written) == shipped_files(model)
    requests = synthetic_requests(DecisionEngine(config).spec.vocab_size)

    def bits(engine):
        return [[s.probabilities.tobytes() for s in r] for r in engine.score(requests)[0]]

    calibrated = bits(DecisionEngine(config))  # the exporter's engine, from its own cache
    for where in ("fleet", "copied"):
        fleet = tmp_path / where
        if where == "copied":  # e.g. an init container's plain `cp -r`: new modification times
            shutil.copytree(model, fleet, copy_function=shutil.copy)
            weights = next(fleet.glob("*.safetensors"))
            os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
        else:
            model.rename(fleet)
        monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path / f"{where}-cache"))
        engine = DecisionEngine(dataclasses.replace(config, model_dir=fleet))
        assert bits(engine) == calibrated and len(calibrations) == 1, where
        assert not (tmp_path / f"{where}-cache").exists() or not list((tmp_path / f"{where}-cache").glob("*.safetensors"))
        assert calibration.sources().count(calibration.SHIPPED_SOURCE) == len(kinds)
        model = fleet


@pytest.mark.parametrize("change", ["weights", "code", "manifest"])
def test_a_shipped_calibration_of_other_weights_or_code_is_not_read(tiny_model_dir, tmp_path, monkeypatch,
                                                                     calibrations, change):
    """Weights rewritten in place with the same size (a fine-tune of the same architecture), another
    Prism or torch, a damaged manifest: the build calibrates as if nothing were shipped."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama_tied"), model)
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", "off")
    config = EngineConfig(model_dir=model, precision="exact")
    calibration.ship(config)
    assert calibration.shipped_entry(model) is not None and len(calibrations) == 1
    if change == "weights":
        weights = next(model.glob("*.safetensors"))
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # the last byte of the last tensor: same size, same header
        weights.write_bytes(bytes(data))
    elif change == "code":
        monkeypatch.setattr(calibration, "_source_digest", lambda: "another Prism")
    else:
        (model / calibration.SHIPPED / calibration.SHIPPED_MANIFEST).write_text("{")
    assert calibration.shipped_entry(model) is None
    stats_of(model)
    assert len(calibrations) == 2 and "computed" in calibration.sources()


def test_fp32_ships_nothing(tiny_model_dir, tmp_path, calibrations):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("mistral"), model)
    assert calibration.ship(EngineConfig(model_dir=model, precision="fp32")) == []
    assert not (model / calibration.SHIPPED).exists() and not calibrations


def test_a_server_checks_itself_against_the_bits_recorded_at_export(tiny_model_dir, tmp_path, monkeypatch):
    """What prism export-repository records (the self-check's digests on the exporting machine) every
    DecisionStep of the same checkpoint and configuration compares at start: equal passes, a
    differing bit fails the self-check (the metric and alert follow it), another configuration or an
    unshipped checkpoint is not compared, and says why."""
    from prism_backend.serving.decision_step import DecisionStep

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama3"), model)
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path / "cache"))
    config = EngineConfig(model_dir=model, precision="int8", num_threads=2)
    unshipped = DecisionStep(config)
    assert unshipped.self_check_ok and unshipped.export_check.endswith("no calibration shipped")
    calibration.ship(config)
    calibration.record_exported_bits(config, unshipped.self_check_digests)
    manifest = model / calibration.SHIPPED / calibration.SHIPPED_MANIFEST
    assert json.loads(manifest.read_text())["exported_bits"]["digests"] == unshipped.self_check_digests

    fleet = tmp_path / "fleet"
    model.rename(fleet)
    monkeypatch.setenv("PRISM_CALIBRATION_CACHE", str(tmp_path / "fleet-cache"))
    # another thread count and tensor-parallel degree than the exporter's: the same bits, compared
    same = DecisionStep(dataclasses.replace(config, model_dir=fleet, num_threads=1))
    assert same.self_check_ok and same.export_check == "equal to the bits recorded at export"
    other = DecisionStep(dataclasses.replace(config, model_dir=fleet, keep_exact="down"))
    assert other.self_check_ok and other.export_check.endswith("configured unlike the export (keep_exact)")

    recorded = json.loads((fleet / calibration.SHIPPED / calibration.SHIPPED_MANIFEST).read_text())
    recorded["exported_bits"]["digests"][0] = "0" * 64
    (fleet / calibration.SHIPPED / calibration.SHIPPED_MANIFEST).write_text(json.dumps(recorded))
    differs = DecisionStep(dataclasses.replace(config, model_dir=fleet))
    assert not differs.self_check_ok and differs.export_check == "DIFFERENT from the bits recorded at export"
    assert any("exporting machine" in problem for problem in differs.self_check_problems)
