"""vLLM serving llm-compressor's W8A8 checkpoint on the full eval, beside Prism's int8 plans.

    .venv/bin/python bench/w8a8_full_eval.py [--every 1] [--plans "down,qkv" ""]

`make bench` scores the W8A8 checkpoint on the eval subset only (side_by_side.eval_subset, 112
decisions); this scores it on the labelled eval (`evals/`, 12,400 decisions; `--every N` takes every
N-th document) against the committed fp32 reference (evals/reference-full.json.gz, whose bf16
column is Hugging Face bf16), on the prompt tokens Prism's tokenizer gives every engine, with
vLLM's prefix caching on. Prism's plans are int8 `keep_exact` plans (the default `down,qkv`; `''`
every projection 8-bit, the checkpoint's own bit width). Per set and overall: agreement with fp32's
choice, mean and max over decisions of max |p - p_fp32|, accuracy against the labels (over
decisions). Needs `make bench`'s .venv-vllm and checkpoint (bench/w8a8_checkpoint.py). Writes
bench/results/w8a8_full_eval.md.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from layer_sensitivity import REFERENCE, subset
from vllm_driver import run_vllm
from w8a8_checkpoint import DEFAULT_W8A8
from workloads import write_result

from evals import run_eval
from kernels.cpu.features import machine
from prism_backend.config import EngineConfig
from prism_backend.paths import DEFAULT_MODEL_DIR

W8A8_NAME = "vLLM W8A8 (llm-compressor)"


def plan_name(spec: str) -> str:
    return f"Prism int8, keep_exact={spec!r}" + (" (default)" if spec == EngineConfig.keep_exact else "")


def score(docs: list[dict], indices: list[int], plans: list[str], w8a8_dir: Path, model_dir: Path = DEFAULT_MODEL_DIR,
          reference: Path = REFERENCE) -> tuple[dict[str, dict[str, dict]], dict[str, float], dict[str, float]]:
    """Every engine's probabilities for `docs` (whose decisions sit at `indices` of the reference) ->
    (set -> engine -> run_eval.measures, with "all" for every decision; seconds per engine; set -> fp32's
    own accuracy against the labels)."""
    ref = run_eval._read_json(reference)
    fp32, options = [ref["fp32"][i] for i in indices], [ref["options"][i] for i in indices]
    tasks = [t for d in docs for t in d["tasks"]]
    probs, seconds, prompts = {}, {}, None
    for spec in plans:
        start = time.perf_counter()
        decided = run_eval.run_engine(EngineConfig(model_dir=model_dir, precision="int8", keep_exact=spec), docs,
                                      return_prompt_ids=True)
        seconds[plan_name(spec)] = time.perf_counter() - start
        if [list(d["probabilities"]) for d in decided] != options:
            raise SystemExit("the reference's options differ from this checkout's prompts: rebuild it (make eval)")
        probs[plan_name(spec)] = [list(d["probabilities"].values()) for d in decided]
        prompts = prompts or [(d["prompt_ids"], d["candidate_ids"]) for d in decided]
    start = time.perf_counter()
    probs[W8A8_NAME] = run_vllm([prompts], True, w8a8_dir)["probabilities"]
    seconds[W8A8_NAME] = time.perf_counter() - start
    if ref["bf16"] is not None:
        probs["Hugging Face bf16"] = [ref["bf16"][i] for i in indices]
    groups = {"all": range(len(tasks))}
    for name in sorted({t["set"] for t in tasks}):
        groups[name] = [i for i, t in enumerate(tasks) if t["set"] == name]

    def measures(ps, rows):
        return run_eval.measures([ps[i] for i in rows], [fp32[i] for i in rows], [options[i] for i in rows],
                                 [tasks[i]["label"] for i in rows])

    table = {group: {engine: measures(ps, rows) for engine, ps in probs.items()} for group, rows in groups.items()}
    return table, seconds, {group: measures(fp32, rows)["accuracy"] for group, rows in groups.items()}


def table_lines(table: dict[str, dict[str, dict]], fp32_accuracy: dict[str, float]) -> list[str]:
    lines = ["| set | engine | decisions | agreement with fp32 | mean err | max err | accuracy (fp32's) |",
             "|---|---|---|---|---|---|---|"]
    for group, engines in table.items():
        for engine, m in engines.items():
            name = f"**{group}**" if group == "all" else group
            lines.append(f"| {name} | {engine} | {m['decisions']} | {m['agreement']:.4f} | {m['mean_err']:.4f} | "
                         f"{m['max_err']:.4f} | {m['accuracy']:.4f} ({fp32_accuracy[group]:.4f}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=1, help="every N-th eval document (1: all)")
    parser.add_argument("--plans", nargs="*", default=[EngineConfig.keep_exact, ""], help="int8 keep_exact plans")
    parser.add_argument("--w8a8-dir", type=Path, default=DEFAULT_W8A8)
    args = parser.parse_args()
    if not args.w8a8_dir.exists():
        raise SystemExit(f"{args.w8a8_dir} not found: `make bench` makes it (bench/w8a8_checkpoint.py)")
    docs, indices = subset(args.every)
    table, seconds, fp32_accuracy = score(docs, indices, args.plans, args.w8a8_dir)
    tasks = [t for d in docs for t in d["tasks"]]
    plans = " ".join(f'"{p}"' for p in args.plans)
    lines = ["# vLLM's W8A8 checkpoint on the full eval, beside Prism's int8 plans", "",
             f"`.venv/bin/python bench/w8a8_full_eval.py --every {args.every} --plans {plans}`, "
             f"{time.strftime('%Y-%m-%d')}, {machine()}: {len(docs)} documents, {len(tasks)} decisions, against the "
             "committed fp32 reference (err = max over a decision's options of |p - p_fp32|; accuracy over decisions). "
             "Seconds per engine: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + ".", ""]
    write_result("w8a8_full_eval.md", lines + table_lines(table, fp32_accuracy))


if __name__ == "__main__":
    main()
