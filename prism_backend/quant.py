"""Linear projections: fp32 reference, and INT8 x INT8 -> INT32 (exact, batch-invariant).

INT8 scheme (W8A8):
  weights      symmetric int8 per output channel, quantised once at load;
  activations  symmetric int8 per token at run time, in `act_passes` passes: pass 1 quantises the
               row, pass 2 quantises what pass 1 left over (its residual), and so on. The passes are
               stacked into one integer GEMM, so extra passes cost rows, not launches;
  product      int8 x int8 accumulated in int32 by `torch._int_mm` (exact: equal to an int64
               matmul), then dequantised in fp32 as sum_p (acc_p * x_scale_p) * w_scale.
Every step is row-wise or exact, so a token's output bits never depend on the other rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = 127.0


def _symmetric_scale(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero row gets scale 1 (its int8 values are all 0 anyway) instead of a division by 0.
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


class Fp32Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias  # (out, in), (out,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act_passes: int = 1):
        """weight: (out, in) float32 -> int8 (in, out) as `_int_mm` takes it, scales (out,)."""
        if act_passes < 1:
            raise ValueError(f"act_passes must be >= 1, got {act_passes}")
        self.w_scale = _symmetric_scale(weight.abs().amax(dim=1)).to(torch.float32)  # (out,)
        self.w_q = torch.round(weight / self.w_scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8).t().contiguous()
        self.bias = bias
        self.act_passes = act_passes

    def quantize_activations(self, x: torch.Tensor):
        """x: (M, in) -> int8 (passes * M, in), scales (passes * M, 1).

        |x / scale| <= 127 by construction of the scale, so rounding needs no clamp."""
        rows, scales = [], []
        residual = x
        for p in range(self.act_passes):
            scale = _symmetric_scale(residual.abs().amax(dim=1, keepdim=True))  # (M, 1)
            q = torch.div(residual, scale).round_()
            rows.append(q.to(torch.int8))
            scales.append(scale)
            if p + 1 < self.act_passes:
                residual = torch.addcmul(residual, q, scale, value=-1.0)  # what this pass missed
        if self.act_passes == 1:
            return rows[0], scales[0]
        return torch.cat(rows), torch.cat(scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        x_q, x_scale = self.quantize_activations(x)
        acc = torch._int_mm(x_q, self.w_q)  # (passes * M, out) int32, exact
        out = torch.mul(acc[:m], x_scale[:m])  # int32 * float32 -> float32 in one pass
        for p in range(1, self.act_passes):  # fixed order: pass 1 + pass 2 + ...
            out.add_(torch.mul(acc[p * m : (p + 1) * m], x_scale[p * m : (p + 1) * m]))
        out.mul_(self.w_scale)
        return out if self.bias is None else out.add_(self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, act_passes: int = 1):
    if precision == "fp32":
        return Fp32Linear(weight, bias)
    if precision == "int8":
        return Int8Linear(weight, bias, act_passes)
    raise ValueError(f"unknown precision {precision!r}")
