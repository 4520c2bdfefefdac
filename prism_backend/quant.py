"""Linear projections: fp32 reference, and INT8 x INT8 -> INT32 (exact, batch-invariant).

INT8 scheme (W8A8):
  weights      symmetric int8 per output channel, quantised once at load, in `weight_passes`
               passes: with 2, what the int8 weight missed (w - s1 * q1) is quantised again per
               output channel (w ~ s1 * q1 + s2 * q2) and multiplies the first activation pass in
               a second integer GEMM. One pass leaves ~0.2% rounding in every weight, the same in
               every token: a slightly different model whose probabilities sit ~0.02 off fp32;
               the residual pass takes that to ~3e-4 for 1.5x the integer work at 2 passes.
  activations  symmetric int8 per token at run time, in `act_passes` passes: pass 1 quantises the
               row, pass 2 quantises what pass 1 left over (its residual), and so on. The passes are
               stacked into one integer GEMM, so extra passes cost rows, not launches;
  product      int8 x int8 accumulated in int32 (exact: equal to an int64 matmul), then
               dequantised in fp32 as (sum_p acc_p * x_scale_p) * w_scale
               (+ (acc_res * x_scale_1) * w_res_scale): on CPU tensors by
               exact int32 products (int_matmul.py: `torch._int_mm`, or an exact fp32 GEMM on CPUs
               without VNNI) + torch, as kernels.int8_gemm.int8_gemm_reference; on CUDA tensors by
               the Triton-lang kernel with the dequantisation fused into its epilogue.
Every step is row-wise or exact, so a token's output bits never depend on the other rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int8_gemm import dequantize

from .int_matmul import ExactWeight

QMAX = 127.0


def _symmetric_scale(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero row gets scale 1 (its int8 values are all 0 anyway) instead of a division by 0.
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


class Fp32Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None):
        """group: a tp.TPGroup when this rank holds a slice of the input columns (row-parallel)."""
        self.weight, self.bias, self.group = weight, bias, group  # (out, in), (out,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.linear(x, self.weight, self.bias)
        out = self.group.all_reduce_sum(F.linear(x, self.weight))  # float sum: close, not bit-exact
        return out if self.bias is None else out.add_(self.bias)


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """The dispatch rule of EngineConfig.kernels: auto = Triton-lang kernels for CUDA tensors."""
    return kernels == "triton" or (kernels == "auto" and x.is_cuda)


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_passes: int = 1,
                 kernels: str = "auto", group=None, weight_passes: int = 1):
        """weight: (out, in) float32 -> int8 (in, out) as `_int_mm` takes it, scales (out,); with
        weight_passes 2 also the residual's int8 (in, out) `w_res` and scales (out,) `w_res_scale`.

        group: a tp.TPGroup when this rank holds a slice of the input columns (row-parallel). The
        row maxima of weights, weight residuals and activations are then all-reduced with MAX and
        the int32 partial products with SUM, all exact, so the output bits equal the unsplit layer's."""
        if act_passes < 1:
            raise ValueError(f"act_passes must be >= 1, got {act_passes}")
        if weight_passes not in (1, 2):
            raise ValueError(f"weight_passes must be 1 or 2, got {weight_passes}")
        self.group = group
        self.w_scale, w_q = self._quantize_weight(weight)  # (out,), (out, in)
        self.w_q = ExactWeight(w_q.to(torch.int8).t().contiguous())  # (in, out)
        self.w_res = self.w_res_scale = None
        if weight_passes == 2:
            # separate multiply and subtract (no fused multiply-add): the same bits in every shard
            residual = weight - w_q * self.w_scale[:, None]  # (out, in), |residual| <= w_scale / 2
            self.w_res_scale, r_q = self._quantize_weight(residual)
            self.w_res = ExactWeight(r_q.to(torch.int8).t().contiguous())  # (in, out)
        self.bias = bias
        self.act_passes = act_passes
        self.kernels = kernels

    def _quantize_weight(self, weight: torch.Tensor):
        """(out, in) float32 -> per-output-channel scales (out,) and rounded values in [-127, 127]."""
        amax = weight.abs().amax(dim=1)
        if self.group is not None:
            self.group.all_reduce_max(amax)
        scale = _symmetric_scale(amax).to(torch.float32)
        return scale, torch.round(weight / scale[:, None]).clamp(-QMAX, QMAX)

    def quantize_activations(self, x: torch.Tensor):
        """x: (M, in) -> int8 (passes * M, in), scales (passes * M, 1).

        |x / scale| <= 127 by construction of the scale, so rounding needs no clamp."""
        rows, scales = [], []
        residual = x
        for p in range(self.act_passes):
            amax = residual.abs().amax(dim=1, keepdim=True)  # (M, 1)
            if self.group is not None:
                self.group.all_reduce_max(amax)
            scale = _symmetric_scale(amax)
            q = torch.div(residual, scale).round_()
            rows.append(q.to(torch.int8))
            scales.append(scale)
            if p + 1 < self.act_passes:
                residual = torch.addcmul(residual, q, scale, value=-1.0)  # what this pass missed
        if self.act_passes == 1:
            return rows[0], scales[0]
        return torch.cat(rows), torch.cat(scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = self.quantize_activations(x)  # (passes * M, in), (passes * M, 1)
        if use_triton(self.kernels, x) and self.group is None:
            from kernels.int8_gemm import int8_gemm

            return int8_gemm(x_q, self.w_q.int8, x_scale, self.w_scale, self.bias, self.act_passes,
                             None if self.w_res is None else self.w_res.int8, self.w_res_scale)
        # the exact int32 products of kernels.int8_gemm.int8_gemm_reference, by this CPU's route
        acc = self.w_q.matmul(x_q)  # (passes * M, out)
        acc_res = None if self.w_res is None else self.w_res.matmul(x_q[: x.shape[0]])  # (M, out)
        if self.group is not None:  # row-parallel: one all-reduce for both products, an exact int32 sum
            summed = self.group.all_reduce_sum(acc if acc_res is None else torch.cat([acc, acc_res]))
            acc, acc_res = (summed, None) if acc_res is None else summed.split([len(x_q), x.shape[0]])
        return dequantize(acc, x_scale, self.w_scale, self.bias, self.act_passes, acc_res, self.w_res_scale)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, act_passes: int = 1,
                kernels: str = "auto", group=None, weight_passes: int = 1):
    if precision == "fp32":
        return Fp32Linear(weight, bias, group)
    if precision == "int8":
        return Int8Linear(weight, bias, act_passes, kernels, group, weight_passes)
    raise ValueError(f"unknown precision {precision!r}")
