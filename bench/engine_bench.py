"""Engine benchmark (no Triton): Prism's forest vs the generic per-question path, in one process.

    .venv/bin/python bench/engine_bench.py [--repeats 7] [--precision fp32]

Engines, all on the same prompts:
  prism forest      all requests of the workload in one forest, candidate-only scoring
  prism unshared    the same engine, but each question alone (no shared prefixes)
  HF generic fp32   Hugging Face transformers, one full forward per question, full-vocabulary softmax
  HF generic bf16   the same in bfloat16
Writes a markdown table to bench/results/engine_<precision>[_<variant>].md (e.g. engine_fp32.md,
engine_int8_act_passes1.md) and prints it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from workloads import RESULTS, WORKLOADS, write_result  # noqa: E402

from kernels.cpu.features import machine  # noqa: E402
from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH  # noqa: E402
from prism_launcher.reference import HFReference  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402



def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--act-passes", type=int, default=None, help="int8 variant (default: the engine's)")
    parser.add_argument("--weight-passes", type=int, default=None, help="int8 variant (default: the engine's)")
    parser.add_argument("--smooth-alpha", type=float, default=None, help="int8 variant (default: the engine's)")
    parser.add_argument("--engines", nargs="+", default=["prism forest", "prism unshared", "HF generic fp32",
                                                          "HF generic bf16"])
    args = parser.parse_args()

    variant = {k: v for k, v in (("act_passes", args.act_passes), ("weight_passes", args.weight_passes),
                                 ("smooth_alpha", args.smooth_alpha)) if v is not None}
    # no prefix cache: the repeats would otherwise measure cache hits (bench/cache_bench.py does that)
    config = EngineConfig(model_dir=args.model_dir, precision=args.precision, prefix_cache_bytes=0, **variant)
    prism = DecisionPipeline(config, REGISTRY_PATH)
    references = {label: HFReference(args.model_dir, dtype)
                  for label, dtype in (("HF generic fp32", torch.float32), ("HF generic bf16", torch.bfloat16))
                  if label in args.engines}

    lines = [f"Engine benchmark: {config.model_dir.name}, prism precision {args.precision} "
             f"(act_passes={config.act_passes}, weight_passes={config.weight_passes}, "
             f"smooth_alpha={config.smooth_alpha}), "
             f"{torch.get_num_threads()} threads, median of {args.repeats} runs (min-max); "
             f"{time.strftime('%Y-%m-%d')}, {machine()}", "",
             "| workload | engine | tokens computed | ms (median) | spread ms | time / prism forest |",
             "|---|---|---|---|---|---|"]
    for name, make in WORKLOADS.items():
        batch = make()
        results, stats = prism.decide_many(batch, return_prompt_ids=True)
        prompts = [(d["prompt_ids"], d["candidate_ids"]) for r in results for d in r]
        singles = [{**r, "tasks": [t]} for r in batch for t in r["tasks"]]
        runs = {
            "prism forest": (stats.tokens_computed, lambda: prism.decide_many(batch)),
            "prism unshared": (stats.tokens_generic, lambda: [prism.decide_many([s]) for s in singles]),
        }
        for label, ref in references.items():
            runs[label] = (stats.tokens_generic,
                           lambda ref=ref: [ref.candidate_probabilities(p, c) for p, c in prompts])
        medians = {}
        runs = {label: run for label, run in runs.items() if label in args.engines or label == "prism forest"}
        for label, (tokens, fn) in runs.items():
            times = [t * 1000 for t in timed(fn, args.repeats)]
            medians[label] = statistics.median(times)
            lines.append(f"| {name} | {label} | {tokens} | {medians[label]:.0f} | "
                         f"{min(times):.0f}-{max(times):.0f} | {medians[label] / medians['prism forest']:.2f}x |")
            print(lines[-1], flush=True)
    suffix = "".join(f"_{k}{v}" for k, v in variant.items())
    name = f"engine_{args.precision}{suffix}.md"
    write_result(name, lines)
    print(f"written to {RESULTS / name}")


if __name__ == "__main__":
    main()
