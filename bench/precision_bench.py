"""Precision benchmark (no Triton): the Prism engine's int8 variants vs fp32, in one process.

    .venv/bin/python bench/precision_bench.py [--repeats 5]

The same forests (bench/workloads.py, prefix cache off) through engines differing only in
precision: fp32 and the int8 pass ladder (model/quant.py): one pass each side (plain W8A8), two
activation passes (13 bits) with one weight pass, two each (the default, 13 x 13 bits). Without VNNI
every one of them is one exact int16 GEMM per projection (kernels/cpu/exact_gemm.py); with AVX-512
VNNI, one pass a side runs the 8-bit kernel of the same library. The routes in use are printed with
the results. Repeats are interleaved
across engines so machine noise hits all alike. Besides the time, each int8 variant's largest
|p - p_fp32| over the workload's decisions (the eval, evals/run_eval.py, measures accuracy at scale).
Writes bench/results/precision.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from workloads import WORKLOADS, write_result  # noqa: E402

from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.model.exact_matmul import route  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    base = EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=threads)
    engines = {
        "fp32": base.replace(precision="fp32"),
        "int8, 1+1 passes (W8A8)": base.replace(precision="int8", act_passes=1, weight_passes=1),
        "int8, 2+1 passes": base.replace(precision="int8", act_passes=2, weight_passes=1),
        "int8, 2+2 passes (default)": base.replace(precision="int8", act_passes=2, weight_passes=2),
    }
    pipelines = {name: DecisionPipeline(config, REGISTRY) for name, config in engines.items()}
    times = {(w, e): [] for w in WORKLOADS for e in engines}
    error = {}  # (workload, engine) -> largest |p - p_fp32| over the workload's decisions
    for workload, make in WORKLOADS.items():
        requests = make()
        probabilities = {}
        for name, pipeline in pipelines.items():
            results, _ = pipeline.decide_many(requests)  # also the warm-up
            probabilities[name] = [p for r in results for d in r for p in d["probabilities"].values()]
        for name in engines:
            error[(workload, name)] = max(abs(p - q) for p, q in zip(probabilities[name], probabilities["fp32"]))
        for _ in range(args.repeats):
            for name, pipeline in pipelines.items():
                start = time.perf_counter()
                pipeline.decide_many(requests)
                times[(workload, name)].append(time.perf_counter() - start)
    lines = ["# Prism engine: int8 vs fp32", "",
             f"`.venv/bin/python bench/precision_bench.py --repeats {args.repeats}` on CPU(s) "
             f"{sorted(os.sched_getaffinity(0))}, {threads} thread(s), prefix cache off, median of "
             f"{args.repeats} interleaved runs; int8 routes (model/exact_matmul.py, timed per pass count): "
             f"1+1 `{route(1, 1)}`, 2+1 `{route(2, 1)}`, 2+2 `{route(2, 2)}`.", "",
             "| workload | engine | ms (median) | min-max ms | time / fp32 | max abs(p - p_fp32) |",
             "|---|---|---|---|---|---|"]
    for workload in WORKLOADS:
        fp32 = statistics.median(times[(workload, "fp32")])
        for name in engines:
            t = times[(workload, name)]
            lines.append(f"| {workload} | {name} | {1000 * statistics.median(t):.0f} | "
                         f"{1000 * min(t):.0f}-{1000 * max(t):.0f} | {statistics.median(t) / fp32:.2f}x | "
                         f"{error[(workload, name)]:.5f} |")
    write_result("precision.md", lines)


if __name__ == "__main__":
    main()
