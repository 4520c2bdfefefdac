"""A compressed-tensors W8A8 checkpoint (what llm-compressor writes and vLLM serves: int8 `weight`
and per-channel `weight_scale` per projection, dynamic per-token activations) is served with its own
integers, through the same exact kernels; other quantisations are refused with a clear message."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from prism_backend.config import EngineConfig
from prism_backend.model.loader import load_model
from prism_backend.model.spec import CheckpointError
from prism_backend.serving.pipeline import DecisionPipeline

from helpers import REGISTRY

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEME = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
          "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
          "targets": ["Linear"]}


def write_w8a8(source, target, scheme=SCHEME, format="int-quantized"):
    """Quantise `source`'s projections per output channel to int8, as llm-compressor stores them."""
    shutil.copytree(source, target)
    (path,) = target.glob("*.safetensors")
    tensors, integers = load_file(path), {}
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            w = tensors[name].float()
            scale = w.abs().amax(dim=1, keepdim=True) / 127  # (out, 1)
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            tensors[name], tensors[name + "_scale"] = q, scale.to(torch.bfloat16)
            integers[name] = q
    save_file(tensors, path)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": format,
                                     "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return integers


def test_a_w8a8_checkpoint_is_served_with_its_own_integers(tiny_model_dir, tmp_path):
    model = tmp_path / "w8a8"
    integers = write_w8a8(tiny_model_dir("llama3"), model)
    spec, weights = load_model(model)
    assert weights.layers[0].integers["o"][0].abs().max() <= 127

    int8 = DecisionPipeline(EngineConfig(model_dir=model, prefix_cache_bytes=0), REGISTRY)
    served = int8.engine.model.proj[0]
    q = integers["model.layers.0.self_attn.q_proj.weight"]  # (q_dim, H)
    assert torch.equal(served.qkv.w.int8_digits()[0][:, : spec.q_dim], q.t())
    assert torch.equal(served.down.w.int8_digits()[0], integers["model.layers.0.mlp.down_proj.weight"].t())
    assert served.qkv.act_passes == served.qkv.weight_passes == 1

    # the same decisions as fp32 on the dequantised weights, to 8-bit activation rounding
    fp32 = DecisionPipeline(EngineConfig(model_dir=model, precision="fp32", prefix_cache_bytes=0), REGISTRY)
    request = [{"material": "The invoice was charged twice.", "tasks": ["team", "severity"]}]
    (a,), _ = int8.decide_many(request)
    (b,), _ = fp32.decide_many(request)
    for x, y in zip(a, b):
        assert np.abs(np.array(list(x["probabilities"].values())) - np.array(list(y["probabilities"].values()))).max() < 0.05


def test_tp2_serves_the_checkpoint_bit_identically(tiny_model_dir, tmp_path):
    model = tmp_path / "w8a8"
    write_w8a8(tiny_model_dir("qwen3"), model)
    request = [{"material": "Login fails since the update.", "tasks": ["team", "reply_time"]}]
    bits = []
    for tp in (1, 2):
        pipeline = DecisionPipeline(EngineConfig(model_dir=model, prefix_cache_bytes=0, tp_size=tp), REGISTRY)
        (result,), _ = pipeline.decide_many(request)
        bits.append([np.array(list(d["probabilities"].values()), np.float32).tobytes() for d in result])
        pipeline.engine.close()
    assert bits[0] == bits[1]


@pytest.mark.parametrize("change", ["group", "static", "format"])
def test_other_quantisations_are_refused(tiny_model_dir, tmp_path, change):
    scheme = json.loads(json.dumps(SCHEME))
    if change == "group":
        scheme["weights"]["strategy"] = "group"
    if change == "static":
        scheme["input_activations"]["dynamic"] = False
    model = tmp_path / change
    write_w8a8(tiny_model_dir("mistral"), model, scheme, "pack-quantized" if change == "format" else "int-quantized")
    with pytest.raises(CheckpointError, match="quantization_config"):
        load_model(model)
