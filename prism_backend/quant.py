"""Linear projections: fp32 reference, and INT8 x INT8 -> INT32 (exact, batch-invariant).

INT8 scheme (W8A8):
  weights      symmetric int8 per output channel, quantised once at load;
  activations  symmetric int8 per token at run time, in `act_passes` passes: pass 1 quantises the
               row, pass 2 quantises what pass 1 left over (its residual), and so on. The passes are
               stacked into one integer GEMM, so extra passes cost rows, not launches;
  product      int8 x int8 accumulated in int32 (exact: equal to an int64 matmul), then
               dequantised in fp32 as sum_p (acc_p * x_scale_p) * w_scale: on CPU tensors by
               `torch._int_mm` + torch (kernels.int8_gemm.int8_gemm_reference), on CUDA tensors by
               the Triton-lang kernel with the dequantisation fused into its epilogue.
Every step is row-wise or exact, so a token's output bits never depend on the other rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int8_gemm import dequantize, int8_gemm_reference

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
                 kernels: str = "auto", group=None):
        """weight: (out, in) float32 -> int8 (in, out) as `_int_mm` takes it, scales (out,).

        group: a tp.TPGroup when this rank holds a slice of the input columns (row-parallel). The
        row maxima of weights and activations are then all-reduced with MAX and the int32 partial
        products with SUM, all exact, so the output bits equal the unsplit layer's."""
        if act_passes < 1:
            raise ValueError(f"act_passes must be >= 1, got {act_passes}")
        self.group = group
        amax = weight.abs().amax(dim=1)
        if group is not None:
            group.all_reduce_max(amax)
        self.w_scale = _symmetric_scale(amax).to(torch.float32)  # (out,)
        self.w_q = torch.round(weight / self.w_scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8).t().contiguous()
        self.bias = bias
        self.act_passes = act_passes
        self.kernels = kernels

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
        if self.group is not None:
            acc = self.group.all_reduce_sum(torch._int_mm(x_q, self.w_q))  # exact int32 sum of the slices
            return dequantize(acc, x_scale, self.w_scale, self.bias, self.act_passes)
        if use_triton(self.kernels, x):
            from kernels.int8_gemm import int8_gemm

            return int8_gemm(x_q, self.w_q, x_scale, self.w_scale, self.bias, self.act_passes)
        return int8_gemm_reference(x_q, self.w_q, x_scale, self.w_scale, self.bias, self.act_passes)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, act_passes: int = 1,
                kernels: str = "auto", group=None):
    if precision == "fp32":
        return Fp32Linear(weight, bias, group)
    if precision == "int8":
        return Int8Linear(weight, bias, act_passes, kernels, group)
    raise ValueError(f"unknown precision {precision!r}")
