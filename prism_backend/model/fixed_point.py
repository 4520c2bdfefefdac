"""Float products that give the same bits on every machine: integers in float64.

A float32 matrix product is a sum of rounded terms, and BLAS libraries sum them in an order that
depends on the CPU's vector width, its vendor (MKL runs a generic code path on AMD and refuses its
AVX2 branch there: mkl_serv_cbwr_set returns MKL_CBWR_ERR_UNSUPPORTED_BRANCH) and the thread
count. The calibration forwards (engine/calibration.py) were such products, so the smoothed
weights and GPTQ's integers, and with them every served probability, differed by CPU kind.

Here each operand row is rounded once to a `bits`-bit integer times a power of two (`to_fixed`).
Products of such integers are below 2^(2 bits) and a sum of K of them below K 2^(2 bits); with
2 bits + ceil(log2 K) <= 53 every partial sum is an integer that float64 holds exactly, so a
float64 GEMM (any BLAS, any blocking, any order, FMA or not) returns the exact integer sum. Scaling
back by powers of two is exact too, and the one rounding to float32 is IEEE's. The result is a
function of the inputs alone. Precision: 21 bits per operand for SmolLM2's widths, against
float32's 24; the calibration statistics need far less.
"""
from __future__ import annotations

import collections
import math
import weakref

import torch

from .layers import apply_prologue

FLOAT64_INTEGER_BITS = 53  # float64 holds every integer below 2^53 exactly


def operand_bits(terms: int) -> int:
    """The largest b such that `terms` products of two integers with |q| <= 2^b sum below 2^53."""
    return (FLOAT64_INTEGER_BITS - math.ceil(math.log2(max(terms, 2)))) // 2


def power_of_two(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, built from its bits (exact; torch.ldexp goes through pow), e in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def to_fixed(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, K) float -> (q (R, K) float64 integers with |q| <= 2^bits, e (R, 1) int64) such that
    x ~ q 2^e, each row with its own power of two: e = E - bits for the row's max |x| = m 2^E,
    m in [0.5, 1) (torch.frexp). Only element-wise IEEE steps (x 2^-e is exact; round is half-even)."""
    _, exponent = torch.frexp(x.abs().amax(dim=-1, keepdim=True).to(torch.float64))
    e = exponent.to(torch.int64) - bits  # (R, 1)
    return x.to(torch.float64).mul_(power_of_two(-e)).round_(), e


HELD_WEIGHTS = 8  # rounded weights kept at once: a layer's projections and the next layer's


class FixedPointLinear:
    """A linear map whose output bits depend only on its inputs: x W^T + b with x's rows and W's
    rows rounded to `operand_bits(in)`-bit integers (power-of-two scales), the product exact in
    float64, rounded once to float32. Replaces an fp32 projection where the bits must not depend on
    the CPU (the calibration forwards); ~2e-7 relative off the float64 product (float32's own
    rounding: 6e-8). W's rounding is kept for the last HELD_WEIGHTS instances that used one, not for
    all: GPTQ's forward runs every forest through a layer before the next (layer_by_layer), so a
    layer's projections reuse theirs (a quarter of that forward's time went to rounding W again),
    while the float64 copies of a whole model's weights (twice its fp32 size) are never held."""

    _holding: collections.deque = collections.deque()  # weak references to the holders, oldest first

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight (out, in) float32 (not changed while this map is used), bias (out,) or None."""
        self.weight, self.bias = weight, bias
        self.bits = operand_bits(weight.shape[1])
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rounded_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """to_fixed(W): (out, in) float64 integers, (out, 1) exponents; the same numbers computed or kept."""
        held = self._held  # a local: another thread's eviction may clear the attribute meanwhile
        if held is None:
            held = self._held = to_fixed(self.weight, self.bits)
            holding = FixedPointLinear._holding
            holding.append(weakref.ref(self))
            while len(holding) > HELD_WEIGHTS:
                oldest = holding.popleft()()
                if oldest is not None:
                    oldest._held = None
        return held

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, prologue=None) -> torch.Tensor:
        """x (N, in) float32 -> (N, out) float32 (+ residual (N, out) last, where given); prologue: x is
        that row pass's input (kernels/cpu/prologues.py, applied first)."""
        x = apply_prologue(prologue, x)
        w_int, w_exponent = self._rounded_weight()  # (out, in), (out, 1)
        x_int, x_exponent = to_fixed(x, self.bits)  # (N, in), (N, 1)
        acc = x_int @ w_int.T  # (N, out): exact integers, whatever the BLAS does
        out = acc.mul_(power_of_two(x_exponent)).mul_(power_of_two(w_exponent.T)).to(torch.float32)
        if self.bias is not None:
            out.add_(self.bias)
        return out if residual is None else out.add_(residual)
