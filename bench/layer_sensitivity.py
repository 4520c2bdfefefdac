"""Which layers' exact projections does the int8 default need? One projection at a time in 8 bits.

    .venv/bin/python bench/layer_sensitivity.py [--every 8] [--plans "down,qkv@0-14" ...] [--no-single]

The default keeps qkv and down_proj of every layer in the exact 13-bit scheme (`keep_exact=down,qkv`),
which costs ~45% of a forward's time on AVX-512 VNNI (vpdpwssd runs at half vpdpbusd's rate). GPTQ's
8-bit integers exist for every projection of every layer whatever the plan (calibration.gptq_integers),
so a plan is only a choice of which projection objects serve. This study builds the default and the
all-8-bit engine once, then for each (projection, layer) of the default's exact set serves that one
projection in 8 bits and measures, on every `--every`-th eval document against the committed fp32
reference (evals/reference-full.json.gz), the mean over decisions of the largest |p - p_fp32| and of
|p - p_default|. Layers whose 8-bit projection moves the probabilities least are candidates for
8 bits; a plan is then checked by the full eval (`make eval`, `evals/run_eval.py --keep-exact`).
`--plans` measures whole plans on the same documents (each built from the two engines' projections).
Writes bench/results/layer_sensitivity.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from workloads import write_result

from evals import run_eval
from kernels.cpu.features import machine
from prism_backend.config import EngineConfig
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH
from prism_backend.serving.pipeline import DecisionPipeline

REFERENCE = run_eval.ROOT / "evals" / "reference-full.json.gz"


def subset(every: int) -> tuple[list[dict], list[int]]:
    """Every `every`-th eval document and the indices of its decisions in the full reference."""
    docs, indices, offset = [], [], 0
    for i, doc in enumerate(run_eval.load(None)):
        if i % every == 0:
            docs.append(doc)
            indices.extend(range(offset, offset + len(doc["tasks"])))
        offset += len(doc["tasks"])
    return docs, indices


def probabilities(pipeline: DecisionPipeline, docs: list[dict]) -> list[np.ndarray]:
    return [np.array(list(d["probabilities"].values()), np.float64) for d in run_eval.decide(pipeline, docs)]


def slot_names(proj, name: str) -> tuple[str, ...]:
    """The attributes that hold projection `name` in one layer (the last layer splits qkv in q, kv)."""
    return ("q", "kv") if name == "qkv" and proj.qkv is None else (name,)


def serve_plan(target, eight_bit, plan: set[tuple[str, int]], names=("qkv", "down")) -> None:
    """Make `target`'s projections exact where (name, layer) is in `plan`, else 8-bit (from `eight_bit`)."""
    for layer, (proj, proj8) in enumerate(zip(target.engine.model.proj, eight_bit.engine.model.proj)):
        for name in names:
            if (name, layer) not in plan:
                for slot in slot_names(proj, name):
                    setattr(proj, slot, getattr(proj8, slot))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=8, help="every N-th eval document")
    parser.add_argument("--plans", nargs="*", default=[], help="keep_exact plans to measure whole")
    parser.add_argument("--no-single", action="store_true", help="only the plans, not one projection at a time")
    args = parser.parse_args()
    docs, indices = subset(args.every)
    ref = run_eval._read_json(REFERENCE)
    fp32 = [np.array(ref["fp32"][i], np.float64) for i in indices]
    options, labels = [ref["options"][i] for i in indices], [t["label"] for d in docs for t in d["tasks"]]
    common = dict(model_dir=DEFAULT_MODEL_DIR, precision="int8", prefix_cache_bytes=0)
    default = DecisionPipeline(EngineConfig(**common), REGISTRY_PATH)
    eight_bit = DecisionPipeline(EngineConfig(**common, keep_exact=""), REGISTRY_PATH)
    layers = len(default.engine.model.proj)
    served = [dict(vars(p)) for p in default.engine.model.proj]  # the default's projections, to go back to

    def restore():
        for proj, projections in zip(default.engine.model.proj, served):
            vars(proj).update(projections)

    t0 = time.perf_counter()
    base = probabilities(default, docs)
    seconds = time.perf_counter() - t0

    def measure(probs):  # the eval's measures against fp32, and how far the default's probabilities moved
        m = run_eval.measures(probs, fp32, options, labels)
        moved = float(np.mean([np.abs(p - b).max() for p, b in zip(probs, base)]))
        return m["agreement"], m["mean_err"], m["max_err"], moved

    rows = [("default (`down,qkv`)", *measure(base))]
    print(rows[-1], f"{seconds:.1f} s a pass", flush=True)
    single = []
    for name in () if args.no_single else ("qkv", "down"):
        for layer in range(layers):
            plan = {(n, i) for n in ("qkv", "down") for i in range(layers)} - {(name, layer)}
            serve_plan(default, eight_bit, plan)
            single.append((f"{name}@{layer} in 8 bits", *measure(probabilities(default, docs))))
            restore()
            print(single[-1], flush=True)
    for spec in args.plans:
        config = EngineConfig(**common, keep_exact=spec)
        if any(name not in ("qkv", "down") for name, _ in config.exact_plan):
            raise SystemExit(f"{spec!r}: only qkv and down can be kept exact here (the default's exact set)")
        plan = {(name, layer) for name in ("qkv", "down") for layer in range(layers) if config.keeps_exact(name, layer)}
        serve_plan(default, eight_bit, plan)
        rows.append((f"plan `{spec}`", *measure(probabilities(default, docs))))
        restore()
        print(rows[-1], flush=True)
    table = ["| served | agreement with fp32 | mean err | max err | mean \\|p - p_default\\| |", "|---|---|---|---|---|"]
    table += [f"| {r[0]} | {r[1]:.4f} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.4f} |"
              for r in rows + sorted(single, key=lambda r: r[4])]
    command = " ".join([f"--every {args.every}", *(["--plans", *(f'"{p}"' for p in args.plans)] if args.plans else []),
                        *(["--no-single"] if args.no_single else [])])
    lines = ["# Which exact projections the int8 default needs", "",
             f"`.venv/bin/python bench/layer_sensitivity.py {command}`, {time.strftime('%Y-%m-%d')}, {machine()}, "
             f"{torch.get_num_threads()} threads: {len(docs)} documents, {len(fp32)} decisions (one eval document "
             f"in {args.every}), against the committed fp32 reference; single rows sorted by how far they move the "
             "default's probabilities.", "", *table]
    write_result("layer_sensitivity.md" if not args.no_single else "layer_sensitivity_plans.md", lines)


if __name__ == "__main__":
    main()
