"""The generic path, for tests, benchmarks and the eval (never served, so not in the engine):
Hugging Face transformers, one full forward per question, full-vocabulary softmax at the last
position, restricted to the candidates and renormalised. This is what Prism must equal (in fp32)
and beat (in speed).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class HFReference:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def candidate_probabilities(self, prompt_ids: list[int], candidate_ids: list[int]) -> np.ndarray:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        logits = self.model(input_ids=ids).logits[0, -1].float()  # (V,)
        full = torch.softmax(logits, dim=-1)
        picked = full[torch.tensor(candidate_ids, dtype=torch.long)]
        return (picked / picked.sum()).numpy()
