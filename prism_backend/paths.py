"""Where things are in a checkout of this repository, named once: the model repository, the task
registry it ships, and the embedded model's converted checkpoint.

The launcher, the tests, the benchmarks and the evals read these. A served model repository never
does: its models resolve their paths from their own config.pbtxt parameters.
"""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
REGISTRY_FILE = "tasks.json"  # the task registry's name inside the tokenizer model's version directory
REGISTRY_PATH = MODEL_REPOSITORY / "prism_tokenizer" / "1" / REGISTRY_FILE
# The embedded model converted to safetensors (prism_launcher/embedded_model.py); Makefile's MODEL_DIR and the
# config.pbtxt defaults (../../.models/...) name the same directory.
DEFAULT_MODEL_DIR = REPO_ROOT / ".models" / "SmolLM2-135M-Instruct"
