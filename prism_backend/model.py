"""The decoder forward over a packed forest, returning only the answer positions' hidden states.

Work that no answer needs is skipped: the last layer computes keys and values for every row (the
answer rows attend to them) but queries, attention output, MLP and the final norm only for the
answer rows; no LM head runs here at all (scoring.py multiplies by the candidate rows only).
"""
from __future__ import annotations

import torch

from .attention import answer_attention, tree_attention
from .forest import Forest
from .layers import apply_rotary, linear, rms_norm, rotary_cos_sin, swiglu
from .loader import LayerWeights, ModelSpec, ModelWeights


class ForestTransformer:
    def __init__(self, spec: ModelSpec, weights: ModelWeights):
        self.spec = spec
        self.w = weights

    def _qk_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.spec.rms_norm_eps)

    def _mlp_block(self, h: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        n = rms_norm(h, lw.post_norm, self.spec.rms_norm_eps)
        return h + linear(swiglu(linear(n, lw.w_gate_up)), lw.w_down)

    def _layer(self, h, lw: LayerWeights, forest: Forest, cos, sin) -> torch.Tensor:
        s = self.spec
        n = rms_norm(h, lw.input_norm, s.rms_norm_eps)
        qkv = linear(n, lw.wqkv, lw.bqkv)  # (N, q_dim + 2 kv_dim)
        q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = self._qk_norm(q.reshape(-1, s.num_heads, s.head_dim), lw.q_norm)
        k = self._qk_norm(k.reshape(-1, s.num_kv_heads, s.head_dim), lw.k_norm)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = tree_attention(q, k, v, forest.segments)  # (N, Hq, D)
        h = h + linear(attn.reshape(-1, s.q_dim), lw.wo)
        return self._mlp_block(h, lw)

    def _last_layer(self, h, lw: LayerWeights, forest: Forest, cos, sin) -> torch.Tensor:
        """Keys/values for every row, everything else for the answer rows only -> (A, H)."""
        s = self.spec
        rows = forest.answer_rows
        n = rms_norm(h, lw.input_norm, s.rms_norm_eps)
        w_q, w_kv = lw.wqkv.split([s.q_dim, 2 * s.kv_dim])
        b_q, b_kv = lw.bqkv.split([s.q_dim, 2 * s.kv_dim]) if lw.bqkv is not None else (None, None)
        k, v = linear(n, w_kv, b_kv).split([s.kv_dim, s.kv_dim], dim=-1)
        q = linear(n[rows], w_q, b_q)
        q = self._qk_norm(q.reshape(-1, s.num_heads, s.head_dim), lw.q_norm)
        k = self._qk_norm(k.reshape(-1, s.num_kv_heads, s.head_dim), lw.k_norm)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        q, k = apply_rotary(q, cos[rows], sin[rows]), apply_rotary(k, cos, sin)
        branches = [seg for seg in forest.segments if seg.is_branch]
        attn = answer_attention(q, k, v, branches)  # (A, Hq, D)
        h = h[rows] + linear(attn.reshape(-1, s.q_dim), lw.wo)
        return self._mlp_block(h, lw)

    @torch.inference_mode()
    def answer_hidden(self, forest: Forest) -> torch.Tensor:
        """Final-normed hidden state of each unique branch's answer position: (A, H)."""
        h = self.w.embed[forest.token_ids]  # (N, H)
        cos, sin = rotary_cos_sin(forest.positions, self.w.inv_freq, self.w.rope_scaling)
        for lw in self.w.layers[:-1]:
            h = self._layer(h, lw, forest, cos, sin)
        h = self._last_layer(h, self.w.layers[-1], forest, cos, sin)
        return rms_norm(h, self.w.final_norm, self.spec.rms_norm_eps)
