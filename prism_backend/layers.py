"""Row-wise building blocks: RMSNorm, rotary embedding, SwiGLU, linear projection.

Each works on one token (one row) at a time, so a token's result never depends on which other
rows are in the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., H) float32, normalised over the last dimension (as Hugging Face's LlamaRMSNorm)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
    """positions: (N,) -> cos, sin: (N, 1, head_dim), broadcast over heads."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # (N, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, head_dim)
    return (emb.cos() * scaling)[:, None, :], (emb.sin() * scaling)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); the rotate-half convention of Hugging Face Llama/Qwen."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (N, in) @ weight: (out, in)^T -> (N, out)."""
    return F.linear(x, weight, bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (N, 2 I) with gate first -> (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
