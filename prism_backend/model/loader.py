"""Load a local Hugging Face checkpoint (config.json + safetensors) into plain tensors.

Supported: Llama (SmolLM2, Llama-3 RoPE scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm);
tied or untied embeddings; grouped-query attention; unquantised, or W8A8 in the compressed-tensors
format that llm-compressor writes and vLLM serves (int8 weights with per-output-channel scales,
activations quantised per token at run time): its integers are kept as they are
(LayerWeights.integers) beside their dequantised float values. The config is parsed by transformers'
AutoConfig and the rotary frequencies come from transformers' own rotary-embedding class for the
architecture, so every RoPE variant those classes know is computed exactly as Hugging Face does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .spec import CheckpointError, ModelSpec, load_config, original_rope_theta, spec_from_config

FLOAT_WEIGHT_FIELDS = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}  # by projection


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (H,)
    wqkv: torch.Tensor  # (q_dim + 2 kv_dim, H): q, k and v projections stacked
    bqkv: torch.Tensor | None  # (q_dim + 2 kv_dim,)
    q_norm: torch.Tensor | None  # (head_dim,)
    k_norm: torch.Tensor | None  # (head_dim,)
    wo: torch.Tensor  # (H, q_dim)
    post_norm: torch.Tensor  # (H,)
    w_gate_up: torch.Tensor  # (2 I, H): gate and up stacked
    w_down: torch.Tensor  # (H, I)
    # 8-bit integer weights rounded offline (GPTQ, engine/calibration.py), by projection name
    # ("qkv", "o", "gate_up", "down"): (integers (out, in), scales (out,)); a projection without an
    # entry is rounded to nearest at load, in the settings' passes
    integers: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    # (act, weight) passes of the projections the precision plan keeps exact, by name
    # (EngineConfig.exact_passes: an item's own, as "down:1+2", else the settings')
    passes: dict[str, tuple[int, int]] | None = None

    def drop_float_weights(self, names) -> None:
        """Forget the float weights of the projections `names` ("qkv", "o", "gate_up", "down"): those
        served from `integers` never read them, and a None weight is neither rotated nor copied."""
        for name in names:
            setattr(self, FLOAT_WEIGHT_FIELDS[name], None)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (V, H)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (H,)
    lm_head: torch.Tensor  # (V, H); the same storage as `embed` when tied
    inv_freq: torch.Tensor  # (head_dim / 2,) rotary inverse frequencies
    rope_scaling: float  # multiplies cos and sin (1.0 except for some RoPE variants)
    # model/rotation.py rotated these weights: down reads its input through a block-diagonal
    # Hadamard of blocks of this many coordinates (0: not rotated)
    down_block: int = 0


def rotary_frequencies(config, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """The checkpoint's RoPE: inverse frequencies (head_dim / 2,) float32 and the factor on cos and
    sin. The original RoPE computed here with the float32 steps of transformers'
    compute_default_rope_parameters (the same in all four architectures; the same bits: tests/
    test_prompt.py), so a plain checkpoint builds without importing transformers' models; any
    other variant by the architecture's rotary class there (`config` is then AutoConfig's)."""
    theta = original_rope_theta(config)
    if theta is not None:
        dim = spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    rotary = _rotary_class(spec.model_type)(config)
    return rotary.inv_freq.to(torch.float32), float(rotary.attention_scaling)


def _rotary_class(model_type: str):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return {
        "llama": LlamaRotaryEmbedding,
        "mistral": MistralRotaryEmbedding,
        "qwen2": Qwen2RotaryEmbedding,
        "qwen3": Qwen3RotaryEmbedding,
    }[model_type]


def _open_tensors(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Map tensor name -> safetensors file holding it."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    where = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                where[name] = path
    return where


class _TensorReader:
    def __init__(self, model_dir: Path):
        self.where = _open_tensors(model_dir)
        self._handles = {}

    def get(self, name: str, shape: tuple[int, ...], rows: slice | None = None, cols: slice | None = None):
        """The tensor, shape-checked; with rows/cols only that slice is read from the file."""
        from safetensors import safe_open

        path = self.where.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        view = self._handles[path].get_slice(name)
        if tuple(view.get_shape()) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(view.get_shape())}, expected {tuple(shape)}")
        if rows is not None:
            tensor = view[rows]
        elif cols is not None:
            tensor = view[:, cols]
        else:
            tensor = view[:]
        return tensor.to(torch.float32).contiguous()

    def has(self, name: str) -> bool:
        return name in self.where


def is_int8_checkpoint(hf) -> bool:
    """Whether the config declares compressed-tensors W8A8 (8-bit symmetric per-channel integer
    weights, dynamic symmetric per-token 8-bit activations, what Prism's int8 products compute);
    any other quantisation is refused with a message naming what it has."""
    q = getattr(hf, "quantization_config", None)
    if q is None:
        return False
    q = q if isinstance(q, dict) else q.to_dict()
    where = f"quantization_config ({q.get('quant_method')!r})"
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "int-quantized":
        raise CheckpointError(f"{where}: only compressed-tensors 'int-quantized' W8A8 checkpoints can be "
                              f"served, this one has format {q.get('format')!r}")
    for name, group in q.get("config_groups", {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (8, "int", True, "channel") \
                or (a.get("num_bits"), a.get("type"), a.get("symmetric"), a.get("strategy"), a.get("dynamic")) \
                != (8, "int", True, "token", True):
            raise CheckpointError(f"{where}, group {name!r}: Prism serves 8-bit symmetric per-channel weights with "
                                  f"dynamic symmetric per-token 8-bit activations; got weights {w}, activations {a}")
    return True


def load_model(model_dir: Path, shard=None) -> tuple[ModelSpec, ModelWeights]:
    """The checkpoint's spec and weights; with a tp.Shard only that rank's heads and MLP columns
    are read (q/k/v and gate/up rows, o and down columns); the rest is replicated."""
    model_dir = Path(model_dir)
    hf = load_config(model_dir)
    spec = spec_from_config(hf)
    r = _TensorReader(model_dir)
    int8 = is_int8_checkpoint(hf)

    def projection(name, shape, rows=None, cols=None):
        """A projection's float weight; for a W8A8 checkpoint also (integers, scales (out,)), the
        scales of this rank's rows (all rows where the split is by columns)."""
        weight = r.get(name + ".weight", shape, rows=rows, cols=cols)
        if not int8:
            return weight, None
        scale = r.get(name + ".weight_scale", (shape[0], 1), rows=rows)[:, 0]
        return weight * scale[:, None], (weight, scale)

    def stacked(parts):
        """(weight, integers) pairs of row blocks -> one stacked pair."""
        weight = torch.cat([w for w, _ in parts])
        if not int8:
            return weight, None
        return weight, (torch.cat([q for _, (q, _) in parts]), torch.cat([s for _, (_, s) in parts]))
    H, D, I = spec.hidden_size, spec.head_dim, spec.intermediate_size
    if shard is None:
        q_rows, kv_rows, columns = slice(0, spec.q_dim), slice(0, spec.kv_dim), slice(0, I)
    else:
        q_rows = slice(shard.q_heads[0] * D, shard.q_heads[1] * D)
        kv_rows = slice(shard.kv_heads[0] * D, shard.kv_heads[1] * D)
        columns = slice(*shard.columns)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        wqkv, qkv_int = stacked([
            projection(a + "q_proj", (spec.q_dim, H), rows=q_rows),
            projection(a + "k_proj", (spec.kv_dim, H), rows=kv_rows),
            projection(a + "v_proj", (spec.kv_dim, H), rows=kv_rows),
        ])
        wo, o_int = projection(a + "o_proj", (H, spec.q_dim), cols=q_rows)
        w_gate_up, gate_up_int = stacked([
            projection(p + "mlp.gate_proj", (I, H), rows=columns),
            projection(p + "mlp.up_proj", (I, H), rows=columns),
        ])
        w_down, down_int = projection(p + "mlp.down_proj", (H, I), cols=columns)
        bqkv = None
        if spec.qkv_bias:
            bqkv = torch.cat([
                r.get(a + "q_proj.bias", (spec.q_dim,), rows=q_rows),
                r.get(a + "k_proj.bias", (spec.kv_dim,), rows=kv_rows),
                r.get(a + "v_proj.bias", (spec.kv_dim,), rows=kv_rows),
            ])
        layers.append(LayerWeights(
            input_norm=r.get(p + "input_layernorm.weight", (H,)),
            wqkv=wqkv,
            bqkv=bqkv,
            q_norm=r.get(a + "q_norm.weight", (D,)) if spec.qk_norm else None,
            k_norm=r.get(a + "k_norm.weight", (D,)) if spec.qk_norm else None,
            wo=wo,
            post_norm=r.get(p + "post_attention_layernorm.weight", (H,)),
            w_gate_up=w_gate_up,
            w_down=w_down,
            integers={"qkv": qkv_int, "o": o_int, "gate_up": gate_up_int, "down": down_int} if int8 else None,
        ))

    embed = r.get("model.embed_tokens.weight", (spec.vocab_size, H))
    if spec.tie_word_embeddings or not r.has("lm_head.weight"):
        if not spec.tie_word_embeddings:
            raise CheckpointError("tensor 'lm_head.weight' is missing and the config does not tie embeddings")
        lm_head = embed
    else:
        lm_head = r.get("lm_head.weight", (spec.vocab_size, H))

    inv_freq, rope_scaling = rotary_frequencies(hf, spec)
    return spec, ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=r.get("model.norm.weight", (H,)),
        lm_head=lm_head,
        inv_freq=inv_freq,
        rope_scaling=rope_scaling,
    )
