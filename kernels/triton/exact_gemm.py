"""The exact GEMM on the GPU: INT8 x INT8 -> exact INT32 sums, the dequantisation fused into the
epilogue (OpenAI Triton).

    out[m, n] = ((sum_p acc_p[m, n] * x_scale[p, m]) * w_scale[n])
                + (acc_r[m, n] * x_scale[0, m]) * w_res_scale[n]      (with a weight residual)
                + bias[n]
    acc_p     = x_q[p * M + m, :] @ w_q[:, n]          exact int32 accumulation
    acc_r     = x_q[m, :] @ w_res[:, n]                 exact int32 accumulation

`passes` is Prism's multi-pass activation quantisation (model/quant.py): the int8 passes of a row,
stacked as extra rows of x_q, each with its own scale (Prism's base-128 digits: 128^(P-1-i) times
the row's scale). `w_res` is the weight's second pass; it multiplies the first activation pass
only (model/quant.py adds the later passes' products with it from a second, raw call). The kernel
folds the terms in that fixed order.

Batch invariance: each program owns one (BLOCK_M, BLOCK_N) output tile and walks K in fixed
BLOCK_K steps from 0 (no split-K, no atomics), so an output element is computed the same way
whatever M is and whichever other rows share its tile. The integer sums are exact anyway; the
fp32 epilogue is element-wise with a fixed operation order, compiled without FMA contraction so
that it rounds like the torch reference step by step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import launch_options


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, w_res_ptr, w_res_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wk, stride_rk, stride_om,
    PASSES: tl.constexpr, DEQUANT: tl.constexpr, HAS_BIAS: tl.constexpr, W_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)  # weight residual x first pass
    for p in tl.static_range(PASSES):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(x_ptr + (p * M + rows)[:, None] * stride_xm + (k0 + ks)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0)  # (BLOCK_M, BLOCK_K) int8
            b = tl.load(w_ptr + (k0 + ks)[:, None] * stride_wk + cols[None, :],
                        mask=k_ok[:, None] & col_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            if W_RES:
                if p == 0:  # the same loaded x tile, times the weight residual
                    r = tl.load(w_res_ptr + (k0 + ks)[:, None] * stride_rk + cols[None, :],
                                mask=k_ok[:, None] & col_ok[None, :], other=0)  # (BLOCK_K, BLOCK_N) int8
                    acc_r = tl.dot(a, r, acc_r, out_dtype=tl.int32)
        if DEQUANT:
            x_scale = tl.load(x_scale_ptr + p * M + rows, mask=row_ok, other=0.0)  # (BLOCK_M,)
            if p == 0:
                out = acc.to(tl.float32) * x_scale[:, None]
            else:
                out = out + acc.to(tl.float32) * x_scale[:, None]
        else:
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc,
                     mask=row_ok[:, None] & col_ok[None, :])
    if DEQUANT:
        out = out * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if W_RES:
            x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)  # the first pass's scales
            res = acc_r.to(tl.float32) * x_scale[:, None]
            out = out + res * tl.load(w_res_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


def _check(x_q: torch.Tensor, w_q: torch.Tensor, passes: int) -> tuple[int, int, int]:
    if x_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise TypeError(f"int8_gemm takes int8 operands, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise ValueError(f"int8_gemm takes 2-D operands, got shapes {tuple(x_q.shape)} and {tuple(w_q.shape)}")
    if x_q.shape[1] != w_q.shape[0]:
        raise ValueError(f"inner dimensions differ: x_q {tuple(x_q.shape)} @ w_q {tuple(w_q.shape)}")
    if passes < 1 or x_q.shape[0] % passes:
        raise ValueError(f"x_q has {x_q.shape[0]} rows, not a multiple of passes={passes}")
    if x_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError("int8_gemm needs a unit stride along the last dimension of both operands")
    if x_q.device != w_q.device:
        raise ValueError(f"operands on different devices: {x_q.device} and {w_q.device}")
    return x_q.shape[0] // passes, w_q.shape[1], x_q.shape[1]


def _check_vector(name: str, t: torch.Tensor | None, length: int, device) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(-1)
    if t.dtype != torch.float32 or t.numel() != length or t.device != device:
        raise ValueError(f"{name} must be float32 with {length} elements on {device}, "
                         f"got {t.dtype} with {t.numel()} on {t.device}")
    return t.contiguous()


def int8_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor | None = None,
              w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, passes: int = 1,
              w_res: torch.Tensor | None = None, w_res_scale: torch.Tensor | None = None,
              block_m: int = 32, block_n: int = 64, block_k: int = 64, num_warps: int = 4,
              num_stages: int | None = None) -> torch.Tensor:
    """x_q: (passes * M, K) int8, w_q: (K, N) int8, optional weight residual w_res: (K, N) int8.

    With scales (x_scale: (passes * M,) or (passes * M, 1), w_scale: (N,), w_res_scale: (N,) with
    w_res, optional bias (N,), all float32) -> dequantised (M, N) float32; without -> the raw
    (M, N) int32 accumulator (passes 1, no residual).
    """
    m, n, k = _check(x_q, w_q, passes)
    dequant = x_scale is not None or w_scale is not None
    if dequant:
        x_scale = _check_vector("x_scale", x_scale, passes * m, x_q.device)
        w_scale = _check_vector("w_scale", w_scale, n, x_q.device)
        if x_scale is None or w_scale is None:
            raise ValueError("dequantisation needs both x_scale and w_scale")
    elif passes != 1 or bias is not None or w_res is not None:
        raise ValueError("the raw int32 output exists for a single pass without bias or weight residual only")
    if (w_res is None) != (w_res_scale is None):
        raise ValueError("a weight residual needs both w_res and w_res_scale")
    if w_res is not None:
        if w_res.dtype != torch.int8 or tuple(w_res.shape) != tuple(w_q.shape) or w_res.stride(1) != 1 \
                or w_res.device != w_q.device:
            raise ValueError(f"w_res must be int8 of w_q's shape {tuple(w_q.shape)} with unit last stride on "
                             f"{w_q.device}, got {w_res.dtype} {tuple(w_res.shape)} on {w_res.device}")
        w_res_scale = _check_vector("w_res_scale", w_res_scale, n, x_q.device)
    bias = _check_vector("bias", bias, n, x_q.device)
    out = torch.empty((m, n), dtype=torch.float32 if dequant else torch.int32, device=x_q.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    dummy = out  # never read: the constexpr flags compile its loads away
    has_res = w_res is not None
    # the tile shape changes no bit: the int32 sums are exact and the epilogue is element-wise
    launch = launch_options(x_q.device, num_warps, num_stages)
    _int8_gemm_kernel[grid](
        x_q, w_q, x_scale if dequant else dummy, w_scale if dequant else dummy,
        w_res if has_res else dummy, w_res_scale if has_res else dummy,
        bias if bias is not None else dummy, out,
        m, n, k, x_q.stride(0), w_q.stride(0), w_res.stride(0) if has_res else 0, out.stride(0),
        PASSES=passes, DEQUANT=dequant, HAS_BIAS=bias is not None, W_RES=has_res,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )
    return out


def int8_gemm_reference(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, passes: int = 1, w_res: torch.Tensor | None = None,
                        w_res_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same computation in torch, the kernel's test oracle: `torch._int_mm` is exact, then the
    same epilogue in the same order. (Prism's CPU path computes the same integers by its own exact
    routes, model/exact_matmul.py, and dequantises in float64.)"""
    acc_res = None if w_res is None else _int_mm(x_q[: x_q.shape[0] // passes], w_res)
    return dequantize(_int_mm(x_q, w_q), x_scale, w_scale, bias, passes, acc_res, w_res_scale)


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch._int_mm`, exact on any shape: its CUDA form takes only more than 16 rows and inner and
    outer sizes that are multiples of 8; other shapes are multiplied on the CPU (the oracle's
    speed matters only where gpu_check times it, at shapes CUDA takes)."""
    if a.is_cuda and not (a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0):
        return torch._int_mm(a.cpu(), b.cpu()).to(a.device)
    return torch._int_mm(a, b)


def dequantize(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               passes: int = 1, acc_res: torch.Tensor | None = None,
               w_res_scale: torch.Tensor | None = None) -> torch.Tensor:
    """acc: (passes * M, N) int32, acc_res: (M, N) int32 or None -> (M, N) float32 =
    (acc_1 * s_1 (+ acc_p * s_p ...)) * w_scale (+ (acc_res * s_1) * w_res_scale) (+ bias)."""
    m = acc.shape[0] // passes
    x_scale = x_scale.reshape(-1, 1)
    out = torch.mul(acc[:m], x_scale[:m])  # int32 * float32 -> float32
    for p in range(1, passes):
        out.add_(torch.mul(acc[p * m : (p + 1) * m], x_scale[p * m : (p + 1) * m]))
    out.mul_(w_scale)
    if acc_res is not None:
        out.add_(torch.mul(acc_res, x_scale[:m]).mul_(w_res_scale))
    return out if bias is None else out.add_(bias)
