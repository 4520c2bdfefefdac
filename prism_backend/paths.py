"""Where things are, named once: in a checkout of this repository, the model repository, the task
registry it ships and the embedded model's converted checkpoint; for this user, Prism's cache
folders (user_cache_dir).

The launcher, the tests, the benchmarks and the evals read these. A served model repository never
does: its models resolve their paths from their own config.pbtxt parameters.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
REGISTRY_FILE = "tasks.json"  # the task registry's name inside the tokenizer model's version directory
REGISTRY_PATH = MODEL_REPOSITORY / "prism_tokenizer" / "1" / REGISTRY_FILE
# The embedded model converted to safetensors (prism_launcher/embedded_model.py); Makefile's MODEL_DIR and the
# config.pbtxt defaults (../../.models/...) name the same directory.
DEFAULT_MODEL_DIR = REPO_ROOT / ".models" / "SmolLM2-135M-Instruct"


def user_cache_dir(kind: str, override: str | None = None) -> Path | None:
    """Where Prism keeps `kind` (calibration, execution-envs, ...) for this user: the folder named by
    the environment variable `override` when it is set, else $XDG_CACHE_HOME/prism/<kind> or
    ~/.cache/prism/<kind>; None without a home directory (a service account). The one rule for
    Prism's user caches (the kernel library is built next to its source, kernels/cpu/exact_gemm.py)."""
    if override and os.environ.get(override):
        return Path(os.environ[override])
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prism" / kind
    except RuntimeError:  # no home directory
        return None
