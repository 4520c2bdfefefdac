"""SmoothQuant-style smoothing, folded into the weights so it costs nothing at run time.

Per-token int8 activations lose precision when a few input channels carry outliers. Smoothing
divides each input channel c of a projection by s[c] = amax_x[c]^alpha / amax_w[c]^(1-alpha) and
multiplies the weight's column c by s[c]: the product is unchanged, the activation is flatter.
The division is folded into whatever produces the activation, so no extra operation runs:

    q/k/v   input = rmsnorm(h) * input_norm   -> divide input_norm
    gate/up input = rmsnorm(h) * post_norm    -> divide post_norm
    o       input = attention output, a mix of v rows -> divide v's output rows (one scale per
                    kv channel, shared by the query heads of its group)
    down    input = silu(gate) * up           -> divide up's output rows

`amax_x` comes from an fp32 forward over calibration prompts built from text that ships with the
package (engine/calibration.py), so the smoothed weights are a pure function of checkpoint and code.
"""
from __future__ import annotations

import math

import torch

from .layers import apply_prologue
from .loader import ModelWeights
from .spec import ModelSpec


class _AbsMax:
    """Wraps an fp32 projection; records the per-input-channel max |x| it sees."""

    def __init__(self, inner):
        self.inner = inner
        self.amax = None

    def __call__(self, x, residual=None, prologue=None):
        x = apply_prologue(prologue, x)
        m = x.abs().amax(dim=0)
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        return self.inner(x, residual)


def calibrate(model, forests) -> list[dict[str, torch.Tensor]]:
    """Run an fp32 ForestTransformer over `forests`; per layer, input amax of qkv, o, gate_up, down."""
    names = ("qkv", "kv", "o", "gate_up", "down")  # kv: the last layer's qkv input (all rows)
    for p in model.proj:
        for name in names:
            if getattr(p, name) is not None:
                setattr(p, name, _AbsMax(getattr(p, name)))
    for forest in forests:
        model.answer_hidden(forest)
    stats = []
    for p in model.proj:
        qkv = p.qkv if p.qkv is not None else p.kv
        stats.append({"qkv": qkv.amax, "o": p.o.amax, "gate_up": p.gate_up.amax, "down": p.down.amax})
        for name in names:
            if getattr(p, name) is not None:
                setattr(p, name, getattr(p, name).inner)
    return stats


def _power(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """x ** exponent, element by element, in float64: IEEE's square root for 0.5 (the default
    alpha), else the C library's pow. Not torch's pow: on float32 it runs MKL's vector math (its sqrt
    for 0.5), whose last bits depend on the code branch MKL picks for the CPU (measured: 0.6% to 17%
    of a million square roots differ from IEEE's, by branch), so the smoothed weights, and every
    bit `exact` serves, differed between an Intel Xeon and an AMD EPYC (tests/test_cpu_kinds.py)."""
    power = math.sqrt if exponent == 0.5 else lambda v: math.pow(v, exponent)
    return torch.tensor([power(v) for v in x.double().flatten().tolist()], dtype=torch.float64).view(x.shape)


def _scales(amax_x: torch.Tensor, amax_w: torch.Tensor, alpha: float) -> torch.Tensor:
    """amax_x^alpha / amax_w^(1 - alpha) per channel, in float64, rounded once to float32."""
    s = _power(amax_x.clamp(min=1e-5), alpha) / _power(amax_w.clamp(min=1e-5), 1 - alpha)
    return s.float().clamp(min=1e-2, max=1e2)


@torch.no_grad()
def apply_smoothing(spec: ModelSpec, weights: ModelWeights, stats: list[dict], alpha: float,
                    reduce_max=None) -> None:
    """Rescale `weights` in place; the fp32 function they compute is unchanged (up to rounding).

    With tensor parallelism `weights` are one rank's shard and `spec` its local shapes; the
    column maxima of q/k/v and gate/up (split by rows) are completed across ranks by
    `reduce_max` (an exact all-reduce MAX), so every rank gets the scales TP = 1 computes."""
    reduce_max = reduce_max or (lambda t: t)
    D, group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    v_rows = slice(spec.q_dim + spec.kv_dim, spec.q_dim + 2 * spec.kv_dim)
    for lw, st in zip(weights.layers, stats):
        s = _scales(st["qkv"], reduce_max(lw.wqkv.abs().amax(0)), alpha)  # (H,)
        lw.input_norm = lw.input_norm / s
        lw.wqkv = lw.wqkv * s

        s = _scales(st["gate_up"], reduce_max(lw.w_gate_up.abs().amax(0)), alpha)  # (H,)
        lw.post_norm = lw.post_norm / s
        lw.w_gate_up = lw.w_gate_up * s

        # o: one scale per kv channel (g, d), the max over the query heads h of its group.
        ax = st["o"].view(spec.num_kv_heads, group, D).amax(1)  # (Hkv, D)
        aw = lw.wo.abs().amax(0).view(spec.num_kv_heads, group, D).amax(1)
        s_kv = _scales(ax, aw, alpha).reshape(-1)  # (kv_dim,)
        lw.wqkv[v_rows] = lw.wqkv[v_rows] / s_kv[:, None]
        if lw.bqkv is not None:
            lw.bqkv = lw.bqkv.clone()
            lw.bqkv[v_rows] = lw.bqkv[v_rows] / s_kv
        s_q = s_kv.view(spec.num_kv_heads, 1, D).expand(-1, group, -1).reshape(-1)  # (q_dim,)
        lw.wo = lw.wo * s_q

        s = _scales(st["down"], lw.w_down.abs().amax(0), alpha)  # (I,)
        up_rows = slice(spec.intermediate_size, 2 * spec.intermediate_size)
        lw.w_gate_up[up_rows] = lw.w_gate_up[up_rows] / s[:, None]
        lw.w_down = lw.w_down * s
