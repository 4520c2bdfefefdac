"""Accuracy parity of the integer paths: the served precision (int8 by default, `--precision exact`
for the 13-bit scheme) and fp32 through the Prism engine, bf16 through Hugging Face.

    .venv/bin/python evals/run_eval.py [--limit N] [--out evals/report.md] [--no-bf16] [--cache F]

For each set: accuracy of int8 (the precision evaluated), fp32 and bf16 against the labels; how often
int8 and bf16 pick the same option as fp32; mean and max over decisions of the largest absolute
probability difference to fp32. `--limit N` takes the
first N documents of each file (the test suite runs a small slice); `--no-bf16` leaves out the
Hugging Face bf16 reference (the slowest part by far on CPUs without bf16 instructions).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "evals" / "data"

from kernels.cpu.features import machine  # noqa: E402
from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_launcher.reference import HFReference  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402

BATCH = 16  # documents per forest


def load(limit: int | None) -> list[dict]:
    docs = []
    for path in sorted(DATA.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        docs.extend(rows[:limit] if limit else rows)
    return docs


def run_engine(config: EngineConfig, docs: list[dict], return_prompt_ids: bool = False) -> list[dict]:
    return decide(DecisionPipeline(config, REGISTRY), docs, return_prompt_ids)


def decide(pipeline: DecisionPipeline, docs: list[dict], return_prompt_ids: bool = False) -> list[dict]:
    """Every decision of `docs`, in order, through `pipeline`, BATCH documents per forest."""
    decisions = []
    for start in range(0, len(docs), BATCH):
        chunk = docs[start : start + BATCH]
        requests = [{"material": d["material"], "tasks": [t["task"] for t in d["tasks"]]} for d in chunk]
        results, _ = pipeline.decide_many(requests, return_prompt_ids)
        for result in results:
            if isinstance(result, Exception):
                raise result
            decisions.extend(result)
    return decisions


# How far the fp32 of the first forest may have moved for a cached reference to stay in use: a kernel
# that sums in another order (or another CPU kind) moves fp32 probabilities by ~1e-7, far below the
# errors the eval measures (~1e-2); a changed prompt, checkpoint or model moves them by far more.
REFERENCE_TOLERANCE = 1e-5


def references(docs: list[dict], model_dir: Path, cache: Path | None, bf16: bool = True,
               tolerance: float = REFERENCE_TOLERANCE) -> dict:
    """fp32 (Prism engine) and bf16 (HF; None without `bf16`) probabilities; cached, since only
    int8 changes between runs. A cache is used only while it still holds this machine's fp32: the
    first forest of documents is recomputed and must give the cached options and probabilities
    within `tolerance` (0: the same bits); else the reference is computed again. The largest
    difference found is returned as "drift" (0.0 for a fresh reference) and the report states it."""
    if cache is not None and cache.exists():
        cached, decisions = _read_json(cache), sum(len(d["tasks"]) for d in docs)
        if len(cached["fp32"]) != decisions:
            raise SystemExit(f"{cache} holds {len(cached['fp32'])} decisions, this run has {decisions}: "
                             "a cache only fits the --limit it was written with")
        drift = _drift(cached, docs, model_dir)
        if drift is not None and drift <= tolerance:
            if drift:
                print(f"{cache}: the fp32 of the first {BATCH} documents moved by at most {drift:.1e} "
                      f"(<= {tolerance:.0e}): reusing the reference", flush=True)
            return {**cached, "drift": drift}
        print(f"{cache}: the fp32 of the first {BATCH} documents changed (code, checkpoint or CPU kind"
              + ("" if drift is None else f"; by up to {drift:.1e}") + "): computing the reference again", flush=True)
    t0 = time.perf_counter()
    fp32 = run_engine(EngineConfig(model_dir=model_dir, precision="fp32"), docs, return_prompt_ids=True)
    t1 = time.perf_counter()
    out = {"options": [list(d["probabilities"]) for d in fp32],
           "fp32": [list(d["probabilities"].values()) for d in fp32], "bf16": None, "timings": {"fp32": t1 - t0},
           "drift": 0.0}
    if bf16:
        reference = HFReference(model_dir, torch.bfloat16)
        out["bf16"] = [reference.candidate_probabilities(d["prompt_ids"], d["candidate_ids"]).tolist() for d in fp32]
        out["timings"]["bf16 (HF, per question)"] = time.perf_counter() - t1
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _write_json(cache, out)
    return out


def _drift(cached: dict, docs: list[dict], model_dir: Path) -> float | None:
    """The largest |fp32 now - fp32 cached| over the first forest's decisions, or None where their
    options differ (another prompt or task registry)."""
    first = run_engine(EngineConfig(model_dir=model_dir, precision="fp32"), docs[:BATCH])
    if cached["options"][: len(first)] != [list(d["probabilities"]) for d in first]:
        return None
    fresh = [list(d["probabilities"].values()) for d in first]
    return max(float(np.abs(np.array(a, np.float64) - np.array(b, np.float64)).max())
               for a, b in zip(cached["fp32"], fresh))


def _read_json(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: Path, value: dict) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        json.dump(value, f)


def measures(probs: list, reference: list, options: list[list[str]], labels: list[str]) -> dict[str, float]:
    """One engine's decisions against the fp32 reference, the eval's measures over all of them:
    agreement of the top option, mean and max over decisions of the largest |p - p_fp32|, accuracy
    against the labels. probs, reference: per decision its options' probabilities."""
    probs = [np.asarray(p, np.float64) for p in probs]
    reference = [np.asarray(r, np.float64) for r in reference]
    errors = [float(np.abs(p - r).max()) for p, r in zip(probs, reference)]
    return {"decisions": len(probs),
            "agreement": float(np.mean([p.argmax() == r.argmax() for p, r in zip(probs, reference)])),
            "mean_err": float(np.mean(errors)), "max_err": max(errors),
            "accuracy": float(np.mean([o[p.argmax()] == label for o, p, label in zip(options, probs, labels)]))}


def evaluate(docs: list[dict], model_dir: Path, int8_config: dict, cache: Path | None = None,
             bf16: bool = True) -> tuple[dict, dict, float]:
    meta = [(t["set"], t["label"]) for d in docs for t in d["tasks"]]
    ref = references(docs, model_dir, cache, bf16)
    timings = dict(ref["timings"])
    t0 = time.perf_counter()
    int8 = run_engine(EngineConfig(model_dir=model_dir, **int8_config), docs)
    timings["int8"] = time.perf_counter() - t0
    options = ref["options"]
    others = ("bf16",) if ref["bf16"] is not None else ()
    probs = {name: [np.array(p, np.float32) for p in ref[name]] for name in ("fp32", *others)}
    probs["int8"] = [np.array(list(d["probabilities"].values()), np.float32) for d in int8]

    per_set: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for i, (set_name, label) in enumerate(meta):
        row = per_set[set_name]
        gold = options[i].index(label)
        for name in ("int8", "fp32", *others):
            row[f"acc_{name}"].append(probs[name][i].argmax() == gold)
        for name in ("int8", *others):
            row[f"agree_{name}"].append(probs[name][i].argmax() == probs["fp32"][i].argmax())
            row[f"err_{name}"].append(float(np.abs(probs[name][i] - probs["fp32"][i]).max()))
    return per_set, timings, ref.get("drift", 0.0)


def report(per_set: dict, timings: dict, n_docs: int, drift: float = 0.0) -> str:
    """The report's table and summary; `drift`: how far a cached reference's fp32 was from this run's."""
    lines = ["| set | decisions | acc int8 | acc fp32 | acc bf16 | agree int8/fp32 | agree bf16/fp32 | "
             "mean err int8 | mean err bf16 | max err int8 | max err bf16 |", "|" + "---|" * 11]
    totals = defaultdict(list)
    for name in sorted(per_set):
        r = per_set[name]
        for k, v in r.items():
            totals[k].extend(v)
        lines.append(_row(name, r))
    lines.append(_row("**all**", totals))
    macro = {k: np.mean([np.mean(per_set[s][k]) for s in per_set]) if k in totals else float("nan")
             for k in ("acc_int8", "acc_fp32", "acc_bf16")}
    lines += ["", f"Average accuracy over the sets: int8 {macro['acc_int8']:.4f}, fp32 {macro['acc_fp32']:.4f}, "
              f"bf16 {macro['acc_bf16']:.4f} (int8 - fp32 = {100 * (macro['acc_int8'] - macro['acc_fp32']):+.2f} points).",
              f"{n_docs} documents. Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + "."]
    if drift:
        lines.append(f"The fp32 and bf16 columns come from a cached reference; this machine's fp32 of the first "
                     f"{BATCH} documents recomputed within {drift:.1e} of it.")
    return "\n".join(lines)


def _row(name, r) -> str:
    m = {k: float(np.mean(v)) for k, v in r.items()}
    if "acc_bf16" not in r:  # --no-bf16
        m.update(acc_bf16=float("nan"), agree_bf16=float("nan"), err_bf16=float("nan"))
    worst_bf16 = max(r["err_bf16"]) if "err_bf16" in r else float("nan")
    return (f"| {name} | {len(r['acc_fp32'])} | {m['acc_int8']:.3f} | {m['acc_fp32']:.3f} | {m['acc_bf16']:.3f} | "
            f"{m['agree_int8']:.3f} | {m['agree_bf16']:.3f} | {m['err_int8']:.4f} | {m['err_bf16']:.4f} | "
            f"{max(r['err_int8']):.4f} | {worst_bf16:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=None, help="documents per file (default: all)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=ROOT / "evals" / "report.md")
    parser.add_argument("--precision", choices=("int8", "exact"), default=None, help="default: the engine's")
    parser.add_argument("--keep-exact", default=None, help="int8's precision plan (default: the engine's)")
    parser.add_argument("--act-passes", type=int, default=None, help="exact variant (default: the engine's)")
    parser.add_argument("--weight-passes", type=int, default=None, help="exact variant (default: the engine's)")
    parser.add_argument("--smooth-alpha", type=float, default=None, help="exact variant (default: the engine's)")
    parser.add_argument("--attention", choices=("integer", "float"), default=None,
                        help="tree attention's arithmetic (default: the engine's)")
    parser.add_argument("--cache", type=Path, default=None, help="reuse fp32/bf16 results from this file")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the Hugging Face bf16 reference")
    args = parser.parse_args()
    docs = load(args.limit)
    int8_config = {k: v for k, v in (("precision", args.precision), ("keep_exact", args.keep_exact),
                                     ("act_passes", args.act_passes), ("weight_passes", args.weight_passes),
                                     ("smooth_alpha", args.smooth_alpha), ("attention", args.attention))
                   if v is not None}
    per_set, timings, drift = evaluate(docs, args.model_dir, int8_config, args.cache, bf16=not args.no_bf16)
    defaults = EngineConfig(model_dir=args.model_dir, **int8_config)
    text = (f"# INT8 accuracy parity ({args.model_dir.name})\n\n"
            f"`.venv/bin/python evals/run_eval.py{'' if args.limit is None else f' --limit {args.limit}'}"
            f"{' --no-bf16' if args.no_bf16 else ''}` on {machine()}, {torch.get_num_threads()} threads, "
            f"{time.strftime('%Y-%m-%d')}; "
            + (f"int8 = precision int8, keep_exact={defaults.keep_exact!r}" if defaults.precision == "int8" else
               f"int8 = precision exact, act_passes={defaults.act_passes}, weight_passes={defaults.weight_passes}, "
               f"smooth_alpha={defaults.smooth_alpha}") + f", attention={defaults.attention!r}\n\n"
            + report(per_set, timings, len(docs), drift) + "\n")
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
