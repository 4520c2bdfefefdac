"""The generic path, for tests, benchmarks and the eval (never served, so not in the engine):
Hugging Face transformers, one full forward per question, full-vocabulary softmax at the last
position, restricted to the candidates and renormalised. This is what Prism must equal (in fp32)
and beat (in speed).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kernels.cpu.features import torch_below_cpu


class HFReference:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        # torch's bf16 SDPA fails where its kernels are forced below the CPU (the forced AVX2 path on
        # an AVX-512 machine: features.torch_below_cpu); the eager attention there, SDPA everywhere else
        forced = dtype == torch.bfloat16 and torch_below_cpu()
        self.attention = "eager" if forced else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=self.attention).eval()
        _correctly_rounded_rotary(self.model)

    @torch.inference_mode()
    def candidate_probabilities(self, prompt_ids: list[int], candidate_ids: list[int]) -> np.ndarray:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        logits = self.model(input_ids=ids).logits[0, -1].float()  # (V,)
        full = torch.softmax(logits, dim=-1)
        picked = full[torch.tensor(candidate_ids, dtype=torch.long)]
        return (picked / picked.sum()).numpy()


def _correctly_rounded_rotary(model) -> None:
    """Every rotary embedding of `model` returns the correctly rounded cos and sin of the angles it
    computed (prism_backend.model.trig, what Prism's rotary table holds) instead of torch's float32
    ones. On an Intel Xeon with AMX, torch's float32 cos gave one of two results per process, about
    one process in 50 (docs/determinism-and-precision.md, "A rare divergence between builds"); in
    one fresh-clone suite run (2026-12-05) this reference's probabilities on the sample ticket moved
    by 4e-5 in one process, past the fp32 tests' 1e-5, while Prism's fp32 gave its usual bits --
    presumably that cos (not reproduced in 8 further processes, so not proven). The angles and the
    scaling are the module's own (`position_ids * inv_freq` in float32, then `* attention_scaling`),
    so only cos and sin's last bits can change, towards the exact values."""
    from prism_backend.model.trig import rotary_cos_sin

    def accurate(module, args, kwargs, output):
        x = args[0] if args else kwargs["x"]
        position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
        freqs = position_ids[..., None].float() * module.inv_freq.to(device=x.device, dtype=torch.float)
        cos, sin = rotary_cos_sin(freqs, getattr(module, "attention_scaling", 1.0))
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            module.register_forward_hook(accurate, with_kwargs=True)
