"""Prism's engine vs vLLM's CPU build on workloads (a) and (b) only: the short form of
side_by_side.py for a machine where its Hugging Face bf16 and matmul-peak phases take too long
(CPUs without bf16 instructions).

    .venv/bin/python bench/vllm_ab.py [--repeats 3]

Each engine alone on the same cores, on the same token ids; every repeat a ticket no engine has seen
(+1 warm-up ticket). Prism's plans run one after another; each peer runs alternately with Prism's
default (side_by_side.peers_alternately: a ticket through each in turn, the peer's driver kept up
and stopped between its calls), and its ratio is to the default's time in those same rounds.
Prism: the engine in-process (prefix cache off) in int8 (the default), int8 with faster precision plans (down kept exact; nothing kept exact), exact
and fp32. vLLM: its offline engine (bench/vllm_driver.py) in its fastest dtype on this CPU
(vllm_driver.fastest_dtype: bf16 where the CPU has bf16 dot products, else fp32) with prefix caching on
and off, in the other dtype with prefix caching on (what shows the choice), and
serving llm-compressor's W8A8 checkpoint with prefix caching on where `make bench` made one
(bench/w8a8_checkpoint.py). Then the probability error of Prism's int8 plans, vLLM and vLLM
W8A8 against Prism fp32 on the eval subset (side_by_side.eval_subset): speed beside accuracy.
llama.cpp (.venv-llama, GGUF Q8_0 converted from the same
checkpoint, bench/llama_cpp_driver.py) where it is installed: the prompts one after another, each
reusing the KV cache of its longest common prefix with the previous one. Writes
bench/results/vllm_ab.md.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from side_by_side import (THREADS, PromptIds, accuracy_rows, eval_subset, peer_sessions, peers_alternately,  # noqa: E402
                          timed, workload_a, workload_b)
from llama_cpp_driver import DEFAULT_GGUF, LLAMA_PYTHON  # noqa: E402
from vllm_driver import DTYPE_NAMES, fastest_dtype  # noqa: E402
from w8a8_checkpoint import DEFAULT_W8A8  # noqa: E402
from workloads import write_result  # noqa: E402

from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="llama.cpp's Q8_0 file (converted if missing)")
    parser.add_argument("--w8a8-dir", type=Path, default=DEFAULT_W8A8, help="vLLM's W8A8 checkpoint (skipped if absent)")
    parser.add_argument("--eval-limit", type=int, default=16, help="eval documents of each set for the error table")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    ticket = iter(range(1, 10**6))
    workloads = {"a: 1 ticket x 3 questions": [workload_a(next(ticket)) for _ in range(args.repeats + 1)],
                 "b: 3 tickets x 1 question": [workload_b(next(ticket)) for _ in range(args.repeats + 1)]}
    ids = PromptIds(args.model_dir)
    times: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    prism = {"prism int8 (default)": {"precision": "int8"},
             "prism int8, down kept exact": {"precision": "int8", "keep_exact": "down"},
             "prism int8, nothing kept exact": {"precision": "int8", "keep_exact": ""},
             "prism exact (13-bit)": {"precision": "exact"},
             "prism fp32": {"precision": "fp32"}}
    for label, settings in prism.items():
        print(label, flush=True)
        pipeline = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS,
                                                 **settings), REGISTRY)
        for w, bs in workloads.items():
            times[w][label] = timed(pipeline.decide_many, bs)
        del pipeline
    dtype = fastest_dtype()
    sessions = peer_sessions(args.model_dir, args.w8a8_dir, args.gguf, vllm=True, dtype=dtype,
                             other_dtype=next(d for d in DTYPE_NAMES if d != dtype))
    if not LLAMA_PYTHON.exists():  # `make bench` builds it; skipped (and said so) where it is not there
        print(f"llama.cpp skipped: {LLAMA_PYTHON} not found (make bench builds it)", flush=True)
    # each peer against the default alternately (side_by_side.peers_alternately), on tickets of its own
    engine = DecisionPipeline(EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=THREADS), REGISTRY)
    versus = peers_alternately(engine.decide_many, sessions, ticket, ids, args.repeats)
    del engine
    print("eval subset", flush=True)
    plans = {label.replace("prism", "Prism"): {k: v for k, v in settings.items() if k != "precision"}
             for label, settings in prism.items() if settings["precision"] == "int8"}
    accuracy = eval_subset(args.model_dir, args.eval_limit, True, args.w8a8_dir, plans, dtype)
    base = "prism int8 (default)"
    lines = ["# Prism engine vs vLLM's CPU build, workloads (a) and (b)", "",
             f"`.venv/bin/python bench/vllm_ab.py --repeats {args.repeats}`: {THREADS} thread(s), CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()}, median of {args.repeats} new tickets per engine. Prism's "
             "plans one after another; each peer alternately with Prism's default (one new ticket through each in "
             "turn, the peer stopped between its calls: side_by_side.peers_alternately), its ratio to the default's "
             "time in those same rounds.", "",
             "| workload | engine | ms (median) | min-max ms | Prism default speed vs this engine |", "|---|---|---|---|---|"]
    for w in workloads:
        ours = statistics.median(times[w][base])
        for label, t in times[w].items():
            med = statistics.median(t)
            lines.append(f"| {w} | {label} | {1000 * med:.0f} | {1000 * min(t):.0f}-{1000 * max(t):.0f} | "
                         f"{med / ours:.2f}x |")
        for label, t in versus[w].items():
            med, prism_med = statistics.median(t["peer"]), statistics.median(t["prism"])
            lines.append(f"| {w} | {label} (alternately; the default {1000 * prism_med:.0f} ms in those rounds) | "
                         f"{1000 * med:.0f} | {1000 * min(t['peer']):.0f}-{1000 * max(t['peer']):.0f} | "
                         f"{med / prism_med:.2f}x |")
    lines += ["", f"Probability error against Prism fp32 on the eval subset (the first {args.eval_limit} documents "
              "of each set, the same prompt tokens for every engine; err = max over a decision's options of "
              "|p - p_fp32|):", ""] + accuracy_rows(accuracy)
    write_result("vllm_ab.md", lines)


if __name__ == "__main__":
    main()
