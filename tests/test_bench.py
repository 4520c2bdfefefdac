"""The side-by-side benchmark's request plumbing: what it times must be what it says it times."""
import threading

import pytest

from side_by_side import VLLM_TICKETS, alternate, prism_tickets, throughput, throughput_tickets

LEVELS = (1, 4, 8)


def test_throughput_tickets_are_new_at_every_level_and_for_every_server():
    """A ticket sent twice is a prefix-cache hit for a server that keeps one (vLLM's 4- and
    8-caller rates were once inflated that way): no material may repeat anywhere in a run."""
    bases = [prism_tickets(i) for i in range(3)] + [VLLM_TICKETS]  # the bench's three servers, and vLLM's
    materials = [r["material"] for base in bases for c in LEVELS for ticket in throughput_tickets(base, c) for r in ticket]
    assert len(materials) == len(set(materials)) == len(bases) * sum(2 * c + 2 for c in LEVELS)


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

    def uniform_vllm(calls, prefix_caching, checkpoint):  # a unit-test stand-in for vLLM's driver
        seen.append((checkpoint, calls))
        return {"probabilities": [[1 / len(c)] * len(c) for _, c in calls[0]]}

    monkeypatch.setattr(side_by_side, "run_vllm", uniform_vllm)
    w8a8 = tmp_path / "w8a8"
    w8a8.mkdir()
    rows = side_by_side.eval_subset(model_dir, 1, True, w8a8)

    fp32 = run_engine(EngineConfig(model_dir=model_dir, precision="fp32"), load(1), return_prompt_ids=True)
    errors = [max(abs(1 / len(d["probabilities"]) - p) for p in d["probabilities"].values()) for d in fp32]
    assert [c for c, _ in seen] == [model_dir, w8a8]
    for _, calls in seen:
        assert calls == [[(d["prompt_ids"], d["candidate_ids"]) for d in fp32]]
    assert rows["Prism fp32"] == {"decisions": len(fp32), "accuracy": rows["Prism fp32"]["accuracy"],
                                  "agreement": 1.0, "mean_err": 0.0, "max_err": 0.0}
    for name in ("vLLM bf16", "vLLM W8A8 (llm-compressor)"):
        assert rows[name]["mean_err"] == pytest.approx(np.mean(errors), abs=1e-6)
        assert rows[name]["max_err"] == pytest.approx(max(errors), abs=1e-6)
    assert 0 < rows["Prism int8 (default)"]["mean_err"] < 0.05
