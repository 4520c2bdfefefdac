"""The side-by-side benchmark's request plumbing: what it times must be what it says it times."""
import threading

import pytest

from side_by_side import (MIN_THROUGHPUT_REQUESTS, VLLM_TICKETS, alternate, peers_alternately, prism_tickets, throughput,
                          throughput_tickets)

LEVELS = (1, 4, 8)


def test_throughput_tickets_are_new_at_every_level_and_for_every_server():
    """A ticket sent twice is a prefix-cache hit for a server that keeps one (vLLM's 4- and
    8-caller rates were once inflated that way): no material may repeat anywhere in a run."""
    bases = [prism_tickets(i) for i in range(3)] + [VLLM_TICKETS]  # the bench's three servers, and vLLM's
    materials = [r["material"] for base in bases for c in LEVELS for ticket in throughput_tickets(base, c) for r in ticket]
    assert len(materials) == len(set(materials)) == len(bases) * sum(max(MIN_THROUGHPUT_REQUESTS, 2 * c + 2) for c in LEVELS)
    assert all(len(throughput_tickets(VLLM_TICKETS, c)) >= MIN_THROUGHPUT_REQUESTS for c in LEVELS)


def test_throughput_sends_every_request_once_with_the_given_concurrency():
    sent, active, peak = [], [0], [0]
    lock = threading.Lock()
    release = threading.Barrier(4)

    def send(request):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        if request < 4:
            release.wait(timeout=10)  # the first four overlap: all four callers are busy at once
        with lock:
            active[0] -= 1
            sent.append(request)

    assert throughput(send, 4, list(range(10))) > 0
    assert sorted(sent) == list(range(10)) and peak[0] == 4


def test_alternate_times_both_senders_on_new_tickets_in_turn():
    """The overhead target's rounds: every batch a new ticket, the senders' order swapped every round,
    round 0 (the warm-up) sent but not timed."""
    sent = []
    run = {"server": lambda batch: sent.append(("server", batch)), "engine": lambda batch: sent.append(("engine", batch))}
    times = alternate(run, lambda n: [n], iter(range(100, 200)), rounds=3)
    assert [who for who, _ in sent] == ["server", "engine", "engine", "server", "server", "engine", "engine", "server"]
    assert [batch for _, batch in sent] == [[n] for n in range(100, 108)]
    assert {name: len(t) for name, t in times.items()} == {"server": 3, "engine": 3}
    assert all(x >= 0 for t in times.values() for x in t)


def test_peers_alternately_pairs_prism_with_each_peer_on_new_tickets_and_keeps_the_drivers_clock():
    """The ratio targets' rounds: for each peer, (a) then (b), Prism's engine and the peer in turn on new
    tickets (order swapped every round), the peer's time the seconds its driver reports, not the wall
    clock around the call; every session closed."""
    sent, closed = [], []

    class Session:  # a unit-test stand-in for driver_io.DriverSession
        def __init__(self, label):
            self.label = label

        def call(self, prompts):
            sent.append((self.label, prompts))
            return {"seconds": 7.0 if self.label == "p" else 9.0, "probabilities": []}

        def close(self):
            closed.append(self.label)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def prism(batch):
        sent.append(("prism", batch))

    ids = lambda batch: [r["material"] for r in batch]  # noqa: E731 -- a batch's "prompts": its materials
    out = peers_alternately(prism, {"p": lambda: Session("p"), "q": lambda: Session("q")}, iter(range(1, 100)), ids, 2)
    assert list(out) == ["a: 1 ticket x 3 questions", "b: 3 tickets x 1 question"] and closed == ["p", "q"]
    assert [who for who, _ in sent[:6]] == ["prism", "p", "p", "prism", "prism", "p"]  # (a) with p: 3 rounds
    assert [who for who, _ in sent[6:12]] == ["prism", "p", "p", "prism", "prism", "p"]  # (b) with p
    materials = [m for who, batch in sent for m in (batch if who != "prism" else [r["material"] for r in batch])]
    assert len(materials) == len(set(materials)) == 2 * 2 * 3 * (1 + 3)  # peers x workloads x rounds x requests
    for w in out:
        assert out[w]["p"]["peer"] == [7.0, 7.0] and out[w]["q"]["peer"] == [9.0, 9.0]
        assert len(out[w]["p"]["prism"]) == 2 and all(0 <= x < 1 for x in out[w]["p"]["prism"])


def test_matmul_peaks_are_the_fastest_round(monkeypatch):
    """A peak is the best round: rounds timed 2 s, 1 s and 3 s (a clock that ticks so) give the GOPS
    of the 1 s round for every dtype."""
    import itertools
    import types

    import side_by_side

    clock = itertools.chain.from_iterable(itertools.repeat((0.0, 2.0, 10.0, 11.0, 20.0, 23.0)))
    monkeypatch.setattr(side_by_side, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    peaks = side_by_side.matmul_peaks(rounds=3, reps=2)
    assert peaks == {name: pytest.approx(2 * 1024 * 2048 * 2048 * 2 / 1.0 / 1e9) for name in ("int8", "bf16", "fp32")}


def test_the_same_width_section_reports_the_rungs_rounds_against_w8a8():
    """The 8-bit rung's pairing with vLLM's W8A8 checkpoint: the ratio of the medians per workload,
    the rounds' spread, and nothing at all where the pairing did not run (no checkpoint)."""
    from side_by_side import W8A8_LABEL, same_width_section

    rounds = {"a: 1 ticket x 3 questions": {W8A8_LABEL: {"prism": [0.30, 0.40, 0.35], "peer": [0.60, 0.50, 0.70]}},
              "b: 3 tickets x 1 question": {W8A8_LABEL: {"prism": [0.40, 0.20, 0.30], "peer": [0.30, 0.30, 0.36]}}}
    lines, ratios = same_width_section(rounds)
    assert ratios == pytest.approx({"a: 1 ticket x 3 questions": 0.60 / 0.35, "b: 3 tickets x 1 question": 1.0})
    rows = [line for line in lines if line.startswith(("| a:", "| b:"))]
    assert rows == [f"| a: 1 ticket x 3 questions | {W8A8_LABEL} | 350 | 600 | 1.71x | 1.25-2.00x |",
                    f"| b: 3 tickets x 1 question | {W8A8_LABEL} | 300 | 300 | 1.00x | 0.75-1.50x |"]
    assert same_width_section({}) == ([], {})
    assert same_width_section({"a: 1 ticket x 3 questions": {}}) == ([], {})


def test_the_amx_plan_section_reports_its_rounds_against_vllm_bf16():
    """The AMX plan's pairing with vLLM bf16 (prefix caching on): its own section, the same rows."""
    from side_by_side import AMX_PLAN, VLLM_BF16_LABEL, amx_plan_section

    rounds = {"a: 1 ticket x 3 questions": {VLLM_BF16_LABEL: {"prism": [0.20, 0.22, 0.21], "peer": [0.25, 0.26, 0.24]}}}
    lines, ratios = amx_plan_section(rounds)
    assert ratios == pytest.approx({"a: 1 ticket x 3 questions": 0.25 / 0.21})
    assert "## The AMX plan against vLLM bf16, alternately" in lines and any(AMX_PLAN in line for line in lines)
    assert [line for line in lines if line.startswith("| a:")] == [
        f"| a: 1 ticket x 3 questions | {VLLM_BF16_LABEL} | 210 | 250 | 1.19x | 1.14-1.25x |"]
    assert amx_plan_section({}) == ([], {})


def test_vllm_runs_in_its_fastest_dtype_for_the_cpu(monkeypatch):
    """bf16 where the CPU itself has bf16 dot products (AVX-512 BF16 or AMX-BF16), fp32 where vLLM would
    emulate bf16 (AVX2, Ice Lake's AVX-512 VNNI); PRISM_CPU_ISA, which caps Prism's kernels, does not
    change vLLM's dtype."""
    import vllm_driver
    from kernels.cpu import features

    monkeypatch.setenv("PRISM_CPU_ISA", "avx2")
    for flags, dtype in (("fpu avx2 fma", "float32"), ("fpu avx2 avx512f avx512bw avx512_vnni", "float32"),
                         ("fpu avx512f avx512_vnni avx512_bf16", "bfloat16"), ("fpu avx512f amx_tile amx_bf16", "bfloat16"),
                         (None, "float32")):
        monkeypatch.setattr(features, "_cpuinfo", lambda field, flags=flags: flags)
        assert vllm_driver.fastest_dtype() == dtype, flags


def test_peer_sessions_name_the_peers_the_targets_read(tmp_path, monkeypatch):
    """The sessions' labels are the ones write_report's ratio targets look up; nothing starts until called."""
    import side_by_side

    monkeypatch.setattr(side_by_side, "LLAMA_PYTHON", tmp_path / "absent")
    sessions = side_by_side.peer_sessions(tmp_path, tmp_path, tmp_path / "m.gguf", vllm=True, other_dtype="float32")
    assert list(sessions) == ["vLLM bf16 prefix on", "vLLM bf16 prefix off", "vLLM fp32 prefix on",
                              side_by_side.W8A8_LABEL]
    assert list(side_by_side.peer_sessions(tmp_path, tmp_path / "absent", tmp_path, vllm=True)) == [
        "vLLM bf16 prefix on", "vLLM bf16 prefix off"]
    # where vLLM's fastest dtype is fp32 (no bf16 dot products): the targets' labels name it
    assert list(side_by_side.peer_sessions(tmp_path, tmp_path / "absent", tmp_path, vllm=True, dtype="float32")) == [
        "vLLM fp32 prefix on", "vLLM fp32 prefix off"]
    assert side_by_side.peer_sessions(tmp_path, tmp_path, tmp_path, vllm=False) == {}


FAKE_DRIVER = """
import json, sys, time
sys.path.insert(0, {bench!r})
from driver_io import driver_calls
spec = json.load(open(sys.argv[1]))
calls, answer = driver_calls(spec)
print("an engine's chatter on stdout")  # must not reach the session's pipe
if answer:
    answer({{"ready": True}})
count = 0
for call in calls:
    count += 1
    if answer:
        answer({{"seconds": 0.25 * count, "probabilities": [[1.0] for _ in call]}})
json.dump({{"seconds": [], "rss_bytes": 1, "startup_seconds": 0.0, "calls": count}}, open(sys.argv[2], "w"))
"""


def test_a_driver_session_answers_call_by_call_and_stops_the_driver_between_calls(tmp_path):
    """driver_io's session: one JSON line per call each way, the driver's other output kept off the pipe,
    the driver stopped (SIGSTOP) between calls so it takes no CPU from what is timed next, OUT at close."""
    import sys
    import time
    from pathlib import Path

    import psutil
    from driver_io import DriverSession

    script = tmp_path / "driver.py"
    script.write_text(FAKE_DRIVER.format(bench=str(Path(__file__).resolve().parent.parent / "bench")))
    with DriverSession(Path(sys.executable), str(script), {"x": 1}) as session:
        first = session.call([([1, 2], [3, 4]), ([5], [6, 7])])
        assert first == {"seconds": 0.25, "probabilities": [[1.0], [1.0]]}
        driver = psutil.Process(session.proc.pid)
        for _ in range(100):  # a signal is delivered asynchronously
            if driver.status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.02)
        assert driver.status() == psutil.STATUS_STOPPED
        assert session.call([([1], [2])])["seconds"] == 0.5
        out = session.close()
    assert out["calls"] == 2 and session.proc.returncode == 0


def test_the_w8a8_checkpoint_calibrates_on_prisms_gptq_prompts(model_dir):
    """vLLM's W8A8 checkpoint is calibrated on what Prism's GPTQ sees: every shipped document with
    every question, as the whole decision prompt a request would be."""
    from tokenizers import Tokenizer
    from w8a8_checkpoint import calibration_prompts

    from prism_backend.engine.calibration_prompts import DOCUMENTS, QUESTIONS

    prompts = calibration_prompts(model_dir)
    assert len(prompts) == len(DOCUMENTS) * len(QUESTIONS)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    first, last = tokenizer.decode(prompts[0]), tokenizer.decode(prompts[-1])
    assert DOCUMENTS[0][:40] in first and QUESTIONS[0][0] in first
    assert DOCUMENTS[-1][:40] in last and QUESTIONS[-1][0] in last


def test_the_eval_subset_scores_every_engine_against_prism_fp32(model_dir, tmp_path, monkeypatch):
    """(e): each peer gets the prompt tokens of Prism's fp32 run, in order, and is scored against
    that run: a peer answering uniform probabilities shows exactly max |uniform - p_fp32|."""
    import numpy as np
    from evals.run_eval import load, run_engine

    import side_by_side
    from prism_backend.config import EngineConfig

    seen = []

    def uniform_vllm(calls, prefix_caching, checkpoint, dtype):  # a unit-test stand-in for vLLM's driver
        seen.append((checkpoint, calls, dtype))
        return {"probabilities": [[1 / len(c)] * len(c) for _, c in calls[0]]}

    monkeypatch.setattr(side_by_side, "run_vllm", uniform_vllm)
    w8a8 = tmp_path / "w8a8"
    w8a8.mkdir()
    rows = side_by_side.eval_subset(model_dir, 1, True, w8a8, dtype="float32")  # vLLM's dtype where no bf16

    fp32 = run_engine(EngineConfig(model_dir=model_dir, precision="fp32"), load(1), return_prompt_ids=True)
    errors = [max(abs(1 / len(d["probabilities"]) - p) for p in d["probabilities"].values()) for d in fp32]
    assert [(c, d) for c, _, d in seen] == [(model_dir, "float32"), (w8a8, "bfloat16")]
    for _, calls, _ in seen:
        assert calls == [[(d["prompt_ids"], d["candidate_ids"]) for d in fp32]]
    assert rows["Prism fp32"] == {"decisions": len(fp32), "accuracy": rows["Prism fp32"]["accuracy"],
                                  "agreement": 1.0, "mean_err": 0.0, "max_err": 0.0}
    for name in ("vLLM fp32", "vLLM W8A8 (llm-compressor)"):
        assert rows[name]["mean_err"] == pytest.approx(np.mean(errors), abs=1e-6)
        assert rows[name]["max_err"] == pytest.approx(max(errors), abs=1e-6)
    assert 0 < rows["Prism int8 (default)"]["mean_err"] < 0.05


def test_the_full_eval_of_the_w8a8_checkpoint_scores_it_on_prism_s_prompt_tokens(model_dir, tmp_path, monkeypatch):
    """bench/w8a8_full_eval.py: vLLM gets the prompt tokens of Prism's run, in the reference's order,
    and every engine is scored against the committed fp32 reference overall and per set -- a stand-in
    answering uniform probabilities shows exactly max |uniform - p_fp32|."""
    import numpy as np

    import w8a8_full_eval
    from evals.run_eval import _read_json
    from layer_sensitivity import REFERENCE, subset

    seen = []

    def uniform_vllm(calls, prefix_caching, checkpoint):  # a unit-test stand-in for vLLM's driver
        seen.append((calls, prefix_caching, checkpoint))
        return {"probabilities": [[1 / len(c)] * len(c) for _, c in calls[0]]}

    monkeypatch.setattr(w8a8_full_eval, "run_vllm", uniform_vllm)
    docs, indices = subset(400)
    table, seconds, fp32_accuracy = w8a8_full_eval.score(docs, indices, ["down,qkv"], tmp_path, model_dir)

    fp32 = [np.array(_read_json(REFERENCE)["fp32"][i]) for i in indices]
    tasks = [t for d in docs for t in d["tasks"]]
    (calls, prefix_caching, checkpoint), = seen
    assert prefix_caching and checkpoint == tmp_path and len(calls[0]) == len(tasks) == len(fp32)
    assert [len(c) for _, c in calls[0]] == [len(f) for f in fp32]
    assert set(table) == {"all"} | {t["set"] for t in tasks}
    uniform = table["all"][w8a8_full_eval.W8A8_NAME]
    errors = [float(np.abs(1 / len(f) - f).max()) for f in fp32]
    assert uniform["mean_err"] == pytest.approx(np.mean(errors)) and uniform["max_err"] == pytest.approx(max(errors))
    default = table["all"][w8a8_full_eval.plan_name("down,qkv")]
    assert default["decisions"] == len(tasks) and 0 < default["mean_err"] < 0.05
    assert sum(table[g][w8a8_full_eval.W8A8_NAME]["decisions"] for g in table if g != "all") == len(tasks)
    assert set(seconds) == {w8a8_full_eval.plan_name("down,qkv"), w8a8_full_eval.W8A8_NAME}
    labels = [t["label"] for t in tasks]
    options = [_read_json(REFERENCE)["options"][i] for i in indices]
    assert set(fp32_accuracy) == set(table) and fp32_accuracy["all"] == pytest.approx(
        np.mean([o[f.argmax()] == label for o, f, label in zip(options, fp32, labels)]))


def test_layer_sensitivity_serves_exactly_the_plans_projections_exact():
    """bench/layer_sensitivity.py mixes the default's and the all-8-bit engine's projections: the
    (name, layer) pairs of the plan keep the default's, every other qkv / down is the 8-bit one's --
    in the last layer both halves of qkv (q and kv)."""
    from types import SimpleNamespace as NS

    from layer_sensitivity import serve_plan

    def engine(tag):
        layers = [NS(qkv=f"{tag}qkv0", q=None, kv=None, down=f"{tag}down0", o=f"{tag}o0"),
                  NS(qkv=None, q=f"{tag}q1", kv=f"{tag}kv1", down=f"{tag}down1", o=f"{tag}o1")]
        return NS(engine=NS(model=NS(proj=layers)))

    target = engine("exact:")
    serve_plan(target, engine("8bit:"), {("qkv", 1), ("down", 0)})
    assert [vars(p) for p in target.engine.model.proj] == [
        {"qkv": "8bit:qkv0", "q": None, "kv": None, "down": "exact:down0", "o": "exact:o0"},
        {"qkv": None, "q": "exact:q1", "kv": "exact:kv1", "down": "8bit:down1", "o": "exact:o1"}]
    serve_plan(target, engine("8bit:"), set())
    assert {p.down for p in target.engine.model.proj} == {"8bit:down0", "8bit:down1"}
    assert target.engine.model.proj[1].q == "8bit:q1" and target.engine.model.proj[1].kv == "8bit:kv1"


def test_the_forward_profile_counts_the_time_outside_the_kernel_library():
    """forward_profile's row "outside the kernel library": every library function the warm-up looked up
    is timed, and the forward's time outside those calls (here a 30 ms sleep around RMSNorm's library
    pass) is reported apart from the steps, not subtracted from "forest, scoring, rest"."""
    import ctypes
    import time

    import torch

    import forward_profile
    from kernels.cpu import exact_gemm, rowwise

    lib = exact_gemm.load()
    assert lib is not None, exact_gemm.why_not()
    before = dict(vars(lib))
    rows, weight = torch.randn(64, 576), torch.rand(576)

    class Pipeline:
        def decide_many(self, requests):
            time.sleep(0.03)
            for _ in range(20):
                rowwise.rms_norm(rows, weight, 1e-5)

    try:
        ms = forward_profile.profile(Pipeline(), [], repeats=3)
        assert not isinstance(vars(lib)["prism_rms_norm"], ctypes._CFuncPtr)  # timed
    finally:
        for name, fn in before.items():
            setattr(lib, name, fn)
    assert 30 <= ms[forward_profile.OUTSIDE] < ms["total"]
    assert ms["forest, scoring, rest"] == ms["total"]  # no step was timed; the outside row is not one


def _probe_in_child(env_extra: dict, code: str) -> str:
    """stdout of `code` run by this interpreter in a child with bench/avx2_site first on PYTHONPATH."""
    import os
    import subprocess
    import sys

    import forced_avx2

    env = {k: v for k, v in os.environ.items() if k not in ("PRISM_CPU_ISA", "PYTHONPATH")}
    env.update(env_extra, PYTHONPATH=str(forced_avx2.SITE))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_forced_avx2_site_makes_torch_probes_answer_as_an_avx2_cpu():
    """vLLM picks its kernel library and attention by torch.cpu's probes; under PRISM_CPU_ISA=avx2 the
    stand-in's sitecustomize replaces each with one saying False, also when torch's spec was asked for
    before the import (as vLLM's dependencies do), and leaves them alone without the variable."""
    code = ("import importlib.util; importlib.util.find_spec('torch'); import torch, sitecustomize; "
            "from sitecustomize import PROBES; "
            "print(sitecustomize.__file__, *[getattr(torch.cpu, p).__module__ + ':' + str(getattr(torch.cpu, p)()) "
            "for p in PROBES if hasattr(torch.cpu, p)])")
    forced = _probe_in_child({"PRISM_CPU_ISA": "avx2"}, code).split()
    assert forced[0].endswith("bench/avx2_site/sitecustomize.py")
    assert len(forced) >= 4 and all(f == "sitecustomize:False" for f in forced[1:]), forced
    native = _probe_in_child({}, code).split()
    assert len(native) == len(forced) and all(f.startswith("torch") for f in native[1:]), native


def test_forced_avx2_environment_and_llama_build():
    """The stand-in caps Prism as the suite's forced AVX2 path does (kernels and torch's dispatch),
    puts every exact product on the int16 route, and names llama.cpp's build without AVX-512."""
    from forced_avx2 import SITE, STANDIN_ENVIRONMENT

    from kernels.cpu.features import AVX2_ENVIRONMENT

    for name in ("PRISM_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        assert STANDIN_ENVIRONMENT[name] == AVX2_ENVIRONMENT[name]
    assert STANDIN_ENVIRONMENT["PRISM_EXACT_ROUTE"] == "int16"
    code = f"import sys; sys.path.insert(0, {str(SITE.parent)!r}); import llama_cpp_driver; print(llama_cpp_driver.LLAMA_PYTHON)"
    assert "/.venv-llama-avx2/" in _probe_in_child({"PRISM_CPU_ISA": "avx2"}, code)
    assert "/.venv-llama/" in _probe_in_child({}, code)


def _measurements(forced: bool) -> dict:
    """A run's saved measurements (side_by_side.MEASUREMENTS) with made-up times: Prism 1 s everywhere,
    vLLM with prefix caching 1.4 s on (a) and 1.17 s on (b), the rest 5 s."""
    import argparse
    from pathlib import Path

    import side_by_side as sbs

    workloads = {w: [None] * 3 for w in sbs.workload_makers((0.0, 0.5))}
    labels = ["prism engine int8", "prism engine fp32", sbs.vllm_label("float32"), sbs.vllm_label("float32", False)]
    times = {w: {e: [1.0] * 2 for e in labels} for w in workloads}
    for w, t in zip(workloads, (1.4, 1.17, 5.0, 5.0)):
        times[w][sbs.vllm_label("float32")] = [t] * 2
        times[w][sbs.vllm_label("float32", False)] = [5.0] * 2
        times[w]["prism engine fp32"] = [5.0] * 2
    args = argparse.Namespace(eval_limit=1, model_dir=Path(sbs.DEFAULT_MODEL_DIR), force_avx2=forced, w8a8_dir=None)
    accuracy = {"Prism int8 (default)": dict(decisions=3, accuracy=1.0, agreement=1.0, mean_err=0.001, max_err=0.002)}
    inputs = (workloads, times, {}, {}, [1, 4, 8], {"int8": 800.0, "bf16": 400.0, "fp32": 200.0}, [0.0, 0.5], 2, 700,
              {}, accuracy, {}, {}, {}, {}, {}, "float32")
    return {"argv": ["bench/side_by_side.py"] + (["--force-avx2"] if forced else []), "args": vars(args), "inputs": inputs}


@pytest.mark.parametrize("forced", [False, True])
def test_report_from_saved_measurements_reads_the_kinds_targets(forced, tmp_path, monkeypatch):
    """`--report-from` writes the page again from a run's saved measurements; a run forced onto the AVX2
    path writes its own page, says it is a stand-in and reads the AVX2 kind's targets (1.3x / 1.15x:
    1.4x and 1.17x meet them), where a run on this machine's own path reads its kind's."""
    import pickle
    import sys

    import side_by_side as sbs
    import workloads as bench_workloads

    from kernels.cpu.features import has_avx512_vnni

    saved = tmp_path / "measurements.pkl"
    saved.write_bytes(pickle.dumps(_measurements(forced)))
    monkeypatch.setattr(bench_workloads, "RESULTS", tmp_path)
    monkeypatch.setattr(sbs, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--report-from", str(saved)])
    monkeypatch.setattr(sbs.forced_avx2, "reexec", lambda: None)  # the page only: no engine runs
    sbs.main()
    page = (tmp_path / ("side_by_side-forced-avx2.md" if forced else "side_by_side.md")).read_text()
    assert ("stand-in for the AVX2 kind" in page) == forced
    assert ("--force-avx2" in page.splitlines()[4]) == forced  # the run's command, not the rewrite's
    goals = (1.3, 1.15) if forced or not has_avx512_vnni() else (1.5, 1.2)
    met = ["yes", "yes"] if goals == (1.3, 1.15) else ["no", "no"]
    rows = [line for line in page.splitlines() if "vs vLLM prefix caching on (phases)" in line]
    assert [r.split("|")[3].strip() for r in rows] == [f">= {g}x" for g in goals]
    assert [r.split("|")[4].strip() for r in rows] == met


def test_forced_avx2_reexec_runs_the_script_again_under_the_stand_in(tmp_path):
    """`--force-avx2` starts the script again with the stand-in's environment and its sitecustomize
    first on PYTHONPATH (on an AVX-512 CPU), and refuses on a CPU without AVX-512, the AVX2 kind itself."""
    import os
    import subprocess
    import sys

    from forced_avx2 import SITE, STANDIN_ENVIRONMENT

    from kernels.cpu.features import cpu_has_avx512_itself

    code = (f"import sys; sys.path.insert(0, {str(SITE.parent)!r}); import os, forced_avx2; forced_avx2.reexec(); "
            "import json; print(json.dumps({k: os.environ.get(k) for k in forced_avx2.STANDIN_ENVIRONMENT}), "
            "os.environ['PYTHONPATH'].split(os.pathsep)[0], forced_avx2.active())")
    env = {k: v for k, v in os.environ.items() if k not in STANDIN_ENVIRONMENT}
    script = tmp_path / "script.py"  # reexec starts sys.argv again: a script, as side_by_side.py is
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    if cpu_has_avx512_itself():
        assert run.returncode == 0, run.stderr
        import json

        given, site, active = run.stdout.rsplit(" ", 2)
        assert json.loads(given) == STANDIN_ENVIRONMENT and site == str(SITE) and active.strip() == "True"
    else:
        assert run.returncode != 0 and "this CPU has no AVX-512" in run.stderr
