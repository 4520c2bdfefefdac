"""Tree attention over a packed forest (torch path).

Every token attends exactly to its ancestors: the rows of its parent segments and the earlier rows
of its own segment. Each segment is computed on its own, with keys gathered from its ancestry,
so a segment's result depends only on its own tree, never on what else is packed in the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .forest import Segment


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, causal: bool) -> torch.Tensor:
    """q: (Lq, Hq, D); k, v: (Lk, Hkv, D) -> (Lq, Hq, D).

    With `causal`, query i sees keys [0, prefix + i]; otherwise every key.
    """
    lq, lk = q.shape[0], k.shape[0]
    mask = None
    if causal and lq > 1:
        # (Lq, Lk): the ancestors (first `prefix` keys) are all visible; own rows causally.
        mask = torch.arange(lk)[None, :] <= (prefix + torch.arange(lq))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
    )  # (1, Hq, Lq, D)
    return out[0].transpose(0, 1)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """All rows: q: (N, Hq, D); k, v: (N, Hkv, D) -> (N, Hq, D)."""
    out = torch.empty_like(q)
    for seg in segments:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _sdpa(q[rows], k[seg.key_rows], v[seg.key_rows], seg.prefix_length, causal=True)
    return out


def answer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branches: list[Segment]) -> torch.Tensor:
    """Only the answer (last) row of each branch: q: (A, Hq, D) in branch order -> (A, Hq, D)."""
    out = torch.empty_like(q)
    for i, seg in enumerate(branches):
        out[i : i + 1] = _sdpa(q[i : i + 1], k[seg.key_rows], v[seg.key_rows], seg.prefix_length, causal=False)
    return out
