"""GPTQ: round a weight matrix to 8-bit integers one input column at a time, each column's rounding
error compensated by the columns not yet rounded (Frantar et al., 2022; the algorithm of the
reference implementation, IST-DASLab/gptq `gptq.py`, in float64).

Round-to-nearest minimises each weight's own error; what matters is the error of the layer's
output on the activations it will see, ||X Wᵀ - X Qᵀ||. With the inputs' second moments
H = Xᵀ X (from calibration prompts), GPTQ quantises column j, then moves its error onto the later
columns along H⁻¹'s Cholesky factor, so that the next roundings absorb it.

Reproducible: every step is float64 arithmetic in a fixed order on one thread (the caller's
torch_threads(1)), and the result is integers; the same Hessian gives the same integers.
"""
from __future__ import annotations

import torch

BLOCK = 128  # columns per lazy-update block (the reference implementation's)
DAMP = 0.01  # dampening, a fraction of the mean diagonal of H


class Hessian:
    """Accumulates H = sum of xᵀ x over the rows a projection sees, in float64."""

    def __init__(self, width: int):
        self.h = torch.zeros(width, width, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (N, width) float32 inputs of the projection."""
        x = x.to(torch.float64)
        self.h.addmm_(x.T, x)
        self.rows += x.shape[0]


def gptq(weight: torch.Tensor, h: torch.Tensor, bound: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float32, h (in, in) float64 -> (integers (out, in) float32 with
    |q| <= bound, per-output-channel scales (out,) float32) such that q * scale ~ weight on the
    inputs h describes. Scales are symmetric min-max (amax / bound), as round-to-nearest's."""
    w = weight.to(torch.float64).clone()
    out_dim, in_dim = w.shape
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / bound, torch.ones_like(amax)).float()  # (out,)
    s = scale.to(torch.float64)[:, None]  # the float32 scale the engine dequantises with

    h = h.clone()
    dead = torch.diag(h) == 0  # inputs never seen: their weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(in_dim, dtype=torch.float64)
    # the upper Cholesky factor of H^-1: row j holds how column j's error spreads to the later ones
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros_like(w)
    for start in range(0, in_dim, BLOCK):
        end = min(start + BLOCK, in_dim)
        w_block = w[:, start:end].clone()
        err_block = torch.zeros_like(w_block)
        u_block = u[start:end, start:end]
        for j in range(end - start):
            column = w_block[:, j]
            q_col = torch.clamp(torch.round(column / s[:, 0]), -bound, bound)
            q[:, start + j] = q_col
            err = (column - q_col * s[:, 0]) / u_block[j, j]
            w_block[:, j:] -= err[:, None] * u_block[j, j:][None, :]
            err_block[:, j] = err
        w[:, end:] -= err_block @ u[start:end, end:]
    return q.float(), scale


class _Recorder:
    """Wraps an fp32 projection; accumulates the Hessian of the inputs it sees."""

    def __init__(self, inner, width: int):
        self.inner, self.hessian = inner, Hessian(width)

    def __call__(self, x):
        self.hessian.add(x)
        return self.inner(x)


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def collect_hessians(model, forests) -> list[dict[str, torch.Tensor]]:
    """Run an fp32 ForestTransformer built with every_row=True over `forests`; per layer, the
    Hessian (in, in) float64 of each projection's inputs (down's after the online rotation)."""
    for p in model.proj:
        for name in PROJECTIONS:
            inner = getattr(p, name)
            setattr(p, name, _Recorder(inner, inner.weight.shape[1]))
    for forest in forests:
        model.answer_hidden(forest)
    hessians = []
    for p in model.proj:
        hessians.append({name: getattr(p, name).hessian.h for name in PROJECTIONS})
        for name in PROJECTIONS:
            setattr(p, name, getattr(p, name).inner)
    return hessians


def quantize_all(weights, hessians: list[dict[str, torch.Tensor]]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """GPTQ's 8-bit integers and scales of every projection, per layer (name -> (q, scale))."""
    integers = []
    for lw, h in zip(weights.layers, hessians):
        named = {"qkv": lw.wqkv, "o": lw.wo, "gate_up": lw.w_gate_up, "down": lw.w_down}
        integers.append({name: gptq(named[name], h[name]) for name in PROJECTIONS})
    return integers
