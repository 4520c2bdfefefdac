"""The precision ladder (no Triton): speed and accuracy of each precision Prism serves, in one process.

    .venv/bin/python bench/precision_bench.py [--repeats 5] [--limit 16]

Rungs: fp32; `exact` (13-bit integers, SmoothQuant); `int8` with nothing kept exact (rotated model,
GPTQ 8-bit weights, 8-bit activations, every projection); int8 with down kept exact (75% of the
MACs in 8 bits); the default plan (EngineConfig.keep_exact); plain round-to-nearest W8A8 on the unrotated model (the
exact scheme with one pass a side). Speed: the same forests (bench/workloads.py (a) and (b), prefix
cache off) through every engine, repeats interleaved so machine noise hits all alike, medians.
Accuracy: the first `--limit` documents of each eval file (evals/run_eval.py; its fp32 and bf16
references are cached in --reference), against the fp32 engine, with the eval's measures (agreement
of the top option, mean over decisions of the largest |p - p_fp32|, the largest one, accuracy
against the labels). The full eval (`make eval`) measures the default at scale.
Writes bench/results/precision.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from workloads import WORKLOADS, write_result

from evals import run_eval
from kernels.cpu.features import machine
from prism_backend.config import PROJECTIONS, EngineConfig
from prism_backend.model.exact_matmul import describe_chosen_routes
from prism_backend.model.spec import load_hf_config, spec_from_config
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY, user_cache_dir
from prism_backend.serving.pipeline import DecisionPipeline


def rungs(base: EngineConfig) -> dict[str, EngineConfig]:
    return {
        "fp32": base.replace(precision="fp32"),
        "exact (13 x 13 bits)": base.replace(precision="exact"),
        "int8, nothing kept exact": base.replace(precision="int8", keep_exact=""),
        "int8, down kept exact": base.replace(precision="int8", keep_exact="down"),
        f"int8, the default (keep_exact={EngineConfig.keep_exact!r})": base.replace(precision="int8",
                                                                                    keep_exact=EngineConfig.keep_exact),
        "plain W8A8 (round to nearest, unrotated)": base.replace(precision="exact", act_passes=1, weight_passes=1),
    }


def share_8bit(config: EngineConfig) -> float:
    """The share of a token's projection MACs done as 8-bit x 8-bit products."""
    spec = spec_from_config(load_hf_config(config.model_dir))
    macs = {"qkv": spec.hidden_size * (spec.q_dim + 2 * spec.kv_dim), "o": spec.q_dim * spec.hidden_size,
            "gate_up": 2 * spec.hidden_size * spec.intermediate_size, "down": spec.intermediate_size * spec.hidden_size}
    total = spec.num_layers * sum(macs.values())
    if config.precision == "fp32":
        return 0.0
    if config.precision == "exact":
        return 1.0 if config.act_passes == config.weight_passes == 1 else 0.0
    return sum(macs[name] for layer in range(spec.num_layers) for name in PROJECTIONS
               if not config.keeps_exact(name, layer)) / total


def accuracy(config: EngineConfig, docs, reference) -> dict[str, float]:
    decisions = run_eval.run_engine(config, docs)
    return run_eval.measures([list(d["probabilities"].values()) for d in decisions], reference["fp32"],
                             reference["options"], [t["label"] for d in docs for t in d["tasks"]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--limit", type=int, default=16, help="eval documents per file for the accuracy columns")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--reference", type=Path, default=None,
                        help="fp32/bf16 reference cache (default: in the user cache, per --limit)")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    base = EngineConfig(model_dir=args.model_dir, prefix_cache_bytes=0, num_threads=threads)
    engines = rungs(base)

    docs = run_eval.load(args.limit)
    reference_path = args.reference or user_cache_dir("eval") / f"reference-limit{args.limit}.json"
    reference = run_eval.references(docs, args.model_dir, reference_path)
    quality = {name: accuracy(config, docs, reference) for name, config in engines.items()}
    bf16 = run_eval.measures(reference["bf16"], reference["fp32"], reference["options"],
                             [t["label"] for d in docs for t in d["tasks"]])

    pipelines = {name: DecisionPipeline(config, REGISTRY) for name, config in engines.items()}
    times = {(w, e): [] for w in WORKLOADS for e in engines}
    for workload, make in WORKLOADS.items():
        requests = make()
        for pipeline in pipelines.values():
            pipeline.decide_many(requests)  # warm-up
        for _ in range(args.repeats):
            for name, pipeline in pipelines.items():
                start = time.perf_counter()
                pipeline.decide_many(requests)
                times[(workload, name)].append(time.perf_counter() - start)

    ms = {key: 1000 * statistics.median(t) for key, t in times.items()}
    routes = describe_chosen_routes() or "none"
    a, b = WORKLOADS
    lines = ["# The precision ladder", "",
             f"`.venv/bin/python bench/precision_bench.py --repeats {args.repeats} --limit {args.limit}`, "
             f"{time.strftime('%Y-%m-%d')}, on {machine()}, {threads} thread(s), prefix cache off; speed: median of {args.repeats} interleaved "
             f"runs per workload; accuracy: the first {args.limit} documents of each eval file "
             f"({bf16['decisions']} decisions) against the fp32 engine (mean/max: of each decision's largest "
             f"|p - p_fp32|). Exact-product routes the engines chose here (model/exact_matmul.py; passes, "
             f"K x N): {routes}.", "",
             "| precision | 8-bit MACs | (a) ms | (a) / fp32 | (b) ms | (b) / fp32 | agreement | mean abs dp | "
             "max abs dp | accuracy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, config in engines.items():
        q = quality[name]
        lines.append(f"| {name} | {100 * share_8bit(config):.0f}% | {ms[(a, name)]:.0f} | "
                     f"{ms[(a, name)] / ms[(a, 'fp32')]:.2f}x | {ms[(b, name)]:.0f} | "
                     f"{ms[(b, name)] / ms[(b, 'fp32')]:.2f}x | {q['agreement']:.3f} | {q['mean_err']:.4f} | "
                     f"{q['max_err']:.4f} | {q['accuracy']:.3f} |")
    lines.append(f"| bf16 (Hugging Face, for comparison) | | | | | | {bf16['agreement']:.3f} | {bf16['mean_err']:.4f} | "
                 f"{bf16['max_err']:.4f} | {bf16['accuracy']:.3f} |")
    write_result("precision.md", lines)


if __name__ == "__main__":
    main()
