"""The model as a compressed-tensors W8A8 checkpoint made by llm-compressor (SmoothQuant + GPTQ):
what vLLM's int8 path serves in the side by side. The maker runs inside .venv-llmc.

    .venv/bin/python bench/w8a8_checkpoint.py MODEL_DIR OUT_DIR      (what `make bench` runs)

The recipe is llm-compressor's own W8A8 int8 example: SmoothQuantModifier(smoothing_strength=0.8),
then GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]) -- int8 weights per output
channel rounded by GPTQ, dynamic per-token int8 activations. It calibrates on the prompts Prism's
own GPTQ uses (engine/calibration.py: every shipped document with every question, rendered as a
served decision prompt), so neither side has seen the eval sets or the benchmark's tickets.

IN (driver): {"model_dir": str, "out_dir": str, "prompts": [[int]]}; OUT: {"seconds": float}.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from driver_io import run_driver

ROOT = Path(__file__).resolve().parent.parent
LLMC_PYTHON = ROOT / ".venv-llmc" / "bin" / "python"
DEFAULT_W8A8 = ROOT / ".run" / "SmolLM2-135M-Instruct-W8A8"


def calibration_prompts(model_dir: Path) -> list[list[int]]:
    """Token ids of Prism's GPTQ calibration prompts, each a whole decision prompt."""
    from prism_backend.engine.calibration_prompts import DOCUMENTS, QUESTIONS, SYSTEM
    from prism_backend.text.prompt import render_prompt
    from prism_backend.text.tasks import Task
    from prism_backend.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tasks = [Task("calibration", None, question, options) for question, options in QUESTIONS]
    return [tokenizer.encode(render_prompt(tokenizer, SYSTEM, doc, task)) for doc in DOCUMENTS for task in tasks]


def make(model_dir: Path, out_dir: Path) -> dict:
    """The main virtualenv's side: the prompts from Prism's code, the checkpoint from the driver."""
    spec = {"model_dir": str(model_dir), "out_dir": str(out_dir), "prompts": calibration_prompts(model_dir)}
    return run_driver(LLMC_PYTHON, __file__, spec)


def driver(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    prompts = spec["prompts"]
    data = Dataset.from_dict({"input_ids": prompts, "attention_mask": [[1] * len(p) for p in prompts]})
    recipe = [SmoothQuantModifier(smoothing_strength=0.8),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(prompts),
            max_seq_length=max(map(len, prompts)), shuffle_calibration_samples=False)
    out = Path(spec["out_dir"])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # whole or absent: make's target is the folder
    return {"seconds": time.perf_counter() - start}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):  # inside .venv-llmc
        json.dump(driver(json.load(open(sys.argv[1]))), open(sys.argv[2], "w"))
        return 0
    model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    print(f"{out_dir}: W8A8 by llm-compressor in {make(model_dir, out_dir)['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
