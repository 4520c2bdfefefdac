"""A checkpoint's architecture from its config.json: what Prism supports, the model's shape
(ModelSpec) and its usable context. Imports neither torch nor, until a full config is needed,
transformers, so the tokenizer step can read the context limit in a stub without torch, and the
decision step builds a checkpoint whose config.json names every field it reads without
transformers (whose configuration modules import ~180 MB and ~2.5 s of torch.distributed and
torch._dynamo into the stub)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
WINDOWED = ("mistral", "qwen2", "qwen3")  # the architectures with a sliding-window attention option


class CheckpointError(ValueError):
    """The checkpoint cannot be served; the message names the file, tensor or field."""


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_context: int
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    qk_norm: bool  # Qwen3
    tie_word_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_config(model_dir: Path) -> dict:
    """config.json as written, for a supported architecture."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path} not found: model_dir must be a Hugging Face checkpoint directory")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") not in SUPPORTED:
        raise CheckpointError(
            f"{config_path}: unsupported architecture model_type={raw.get('model_type')!r}; supported: {SUPPORTED}"
        )
    return raw


# What spec_from_config reads (besides the context fields: _context_fields) that has a default in some
# architecture's config class; and per architecture, the fields whose defaults apply only there
# (head_dim is hidden_size / heads where absent, except Qwen3's 128)
SPEC_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "rms_norm_eps", "tie_word_embeddings")
ARCHITECTURE_FIELDS = {"llama": ("attention_bias",), "qwen3": ("attention_bias", "head_dim")}


def load_hf_config(model_dir: Path):
    """The config as transformers' AutoConfig reads it (defaults of the architecture filled in)."""
    from transformers import AutoConfig

    read_config(model_dir)
    return AutoConfig.from_pretrained(Path(model_dir))


def load_config(model_dir: Path):
    """The config the engine builds from: config.json as written (a SimpleNamespace) where it names
    every field Prism reads and asks for the original RoPE, else AutoConfig's. Either gives the
    same ModelSpec and rotary table (tests/test_prompt.py); AutoConfig fills in the architecture's
    defaults for missing fields and knows every RoPE variant."""
    raw = read_config(model_dir)
    as_written = SimpleNamespace(**raw)
    needed = [*SPEC_FIELDS, *_context_fields(raw), *ARCHITECTURE_FIELDS.get(raw["model_type"], ())]
    if original_rope_theta(as_written) is not None and all(key in raw for key in needed):
        return as_written
    return load_hf_config(model_dir)


def original_rope_theta(config) -> float | None:
    """rope_theta where `config` (config.json as a namespace, or AutoConfig's) asks for the original
    RoPE and nothing else (transformers' "default" rope_type), else None."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # the older form: rope_theta, and rope_scaling for a variant
        theta = getattr(config, "rope_theta", None)
        return None if theta is None or getattr(config, "rope_scaling", None) is not None else float(theta)
    if params.get("rope_type") != "default" or set(params) != {"rope_type", "rope_theta"}:
        return None
    return float(params["rope_theta"])


def context_limit(hf) -> int:
    """The longest prompt Prism runs: max_position_embeddings, capped by an active sliding window
    (Prism attends over the whole prompt; past the window that would differ from the model)."""
    limit = hf.max_position_embeddings
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", hf.model_type == "mistral"):
        limit = min(limit, window)
    return limit


def max_context(model_dir: Path) -> int:
    """context_limit of a checkpoint, from config.json alone when it names every field the rule
    reads (checked equal to AutoConfig's in tests/test_prompt.py), else through AutoConfig, whose
    architecture defaults then apply."""
    raw = read_config(model_dir)
    if all(key in raw for key in _context_fields(raw)):
        return context_limit(SimpleNamespace(**raw))
    return context_limit(load_hf_config(model_dir))


def _context_fields(raw: dict) -> list[str]:
    """The fields of config.json that context_limit reads for its architecture."""
    needed = ["max_position_embeddings"]
    if raw["model_type"] in WINDOWED:
        needed.append("sliding_window")
        if raw["model_type"] != "mistral":
            needed.append("use_sliding_window")
    return needed


def spec_from_config(hf) -> ModelSpec:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return ModelSpec(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        rms_norm_eps=hf.rms_norm_eps,
        max_context=context_limit(hf),
        qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=hf.model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
