"""Exact integer matrix products on CPU, by whichever exact route is fastest here.

The int8 scheme (quant.py) multiplies integer activations X (M, K), |X| <= 127 * 128^(P-1) for P
activation passes, by integer weights W (K, N), |W| <= 127 * 128^(Q-1) for Q weight passes. The
product X @ W is an integer matrix; every route below returns it exactly, as float64 (every value
is below 2^53), so which route runs can never change a bit:

  int_mm  X and W cut into their int8 passes (X = sum_i 128^(P-1-i) x_i, likewise W), the P * Q
          int8 x int8 -> int32 products by `torch._int_mm` (exact int32 accumulation), combined in
          int64. With VNNI (oneDNN's int8 kernels) this is the fastest product torch has.
  float   without VNNI (AVX2-only CPUs) `torch._int_mm` is a plain loop: measured on an AVX2
          EPYC, 2.6 s for a (760, 576) x (576, 1536) product that an fp32 GEMM does in 0.13 s.
          There an IEEE GEMM of the integer values is exact whenever every partial sum stays an
          integer the format represents exactly, whatever order the GEMM adds in, with or without
          FMA:
          - one pass each side (|x|, |w| <= 127): float32, K cut into chunks of at most 1,040
            (1040 * 127^2 < 2^24), each chunk's exact result summed in float64;
          - more passes: one float64 GEMM (two passes each: |X W| <= 16256^2 * K < 2^53 for any
            K below 34 million). One float64 GEMM costs about two float32 ones here, i.e. four
            int8 products' worth of precision for the price of two: the reason this route exists.

The route is chosen by timing `torch._int_mm` against a float32 GEMM once per process (or forced
with PRISM_INT8_ROUTE=int_mm|float, for tests and benchmarks).
"""
from __future__ import annotations

import os
import time

import torch

EXACT_FP32_K = 1040  # 1040 * 127 * 127 = 16,774,160 < 2^24 = 16,777,216
PASS_BASE = 128  # passes are base-128 digits: X = sum_i 128^(P-1-i) x_i, |x_0| <= 127, |x_i| <= 64
ROUTES = ("int_mm", "float")
_route: str | None = None


def int_bound(passes: int) -> int:
    """The largest |integer| of a `passes`-pass quantisation: 127, 16256, 2080768."""
    return 127 * PASS_BASE ** (passes - 1)


def int8_passes(x: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """Integer-valued float tensor, |x| <= int_bound(passes) -> its base-128 digits as int8 tensors,
    most significant first (|first| <= 127, |others| <= 64). All steps are exact in float32."""
    digits, rest = [], x
    for i in range(passes - 1, -1, -1):
        digit = torch.round(rest / PASS_BASE**i)  # a division by a power of two: exact
        digits.append(digit.to(torch.int8))
        rest = rest - digit * PASS_BASE**i
    return digits


def _time(fn, repeats: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return time.perf_counter() - start


def route() -> str:
    """The CPU route of this process: PRISM_INT8_ROUTE if set, else `int_mm` where one int8 product
    is at least twice as fast as a float32 GEMM of the same size (VNNI), `float` otherwise; timed
    once on a SmolLM2-sized product (~0.1 s with VNNI, ~1 s without)."""
    global _route
    if _route is None:
        forced = os.environ.get("PRISM_INT8_ROUTE", "")
        if forced:
            if forced not in ROUTES:
                raise ValueError(f"PRISM_INT8_ROUTE must be one of {ROUTES}, got {forced!r}")
            _route = forced
        else:
            gen = torch.Generator().manual_seed(0)
            x = torch.randint(-127, 128, (128, 576), dtype=torch.int8, generator=gen)
            w = torch.randint(-127, 128, (576, 512), dtype=torch.int8, generator=gen)
            xf, wf = x.float(), w.float()
            int_mm = _time(lambda: torch._int_mm(x, w))
            fp32 = _time(lambda: torch.mm(xf, wf))
            # with two passes a side, int_mm runs four products where the float route runs one
            # float64 GEMM (~ two float32 ones)
            _route = "int_mm" if 2 * int_mm <= fp32 else "float"
    return _route


class ExactWeight:
    """An integer weight W (K, N), prepared for one route: int8 digits for `int_mm` (and for the
    Triton-lang kernel), float32 K-chunks (one pass each side) or a float64 copy for `float`."""

    def __init__(self, w_int: torch.Tensor, act_passes: int, weight_passes: int, chosen: str | None = None):
        """w_int: (K, N) integer-valued float32, |w_int| <= int_bound(weight_passes)."""
        self.act_passes, self.weight_passes = act_passes, weight_passes
        self.route = chosen or (route() if not w_int.is_cuda else "int_mm")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {self.route!r}")
        self.digits = None  # (K, N) int8 each, most significant first: int_mm and the Triton-lang kernel
        self.fp32_chunks = self.fp64 = None
        if self.route == "int_mm":
            self.digits = int8_passes(w_int, weight_passes)
        elif act_passes == weight_passes == 1:
            self.fp32_chunks = [c.float() for c in w_int.split(EXACT_FP32_K)]  # (<= 1040, N) float32
        else:
            self.fp64 = w_int.double()  # (K, N) float64

    def int8_digits(self) -> list[torch.Tensor]:
        """W's int8 passes (the Triton-lang kernel's operands), made from the float copy on first use."""
        if self.digits is None:
            w_int = self.fp64.float() if self.fp64 is not None else torch.cat(self.fp32_chunks)
            self.digits = int8_passes(w_int, self.weight_passes)
        return self.digits

    def matmul(self, x_int: torch.Tensor) -> torch.Tensor:
        """x_int: (M, K) integer-valued float32, |x_int| <= int_bound(act_passes) -> (M, N) float64,
        exactly x_int @ w_int."""
        if self.fp64 is not None:
            return torch.mm(x_int.double(), self.fp64)
        if self.fp32_chunks is not None:
            out, start = None, 0
            for chunk in self.fp32_chunks:
                part = torch.mm(x_int[:, start : start + chunk.shape[0]], chunk).double()
                out = part if out is None else out.add_(part)
                start += chunk.shape[0]
            return out
        m = x_int.shape[0]
        x_digits = torch.cat(int8_passes(x_int, self.act_passes))  # (P * M, K) int8, most significant first
        out = None
        for j, w_digit in enumerate(self.digits):
            acc = torch._int_mm(x_digits, w_digit).long()  # (P * M, N), exact int32 sums
            for i in range(self.act_passes):
                weight = PASS_BASE ** (self.act_passes - 1 - i + self.weight_passes - 1 - j)
                part = acc[i * m : (i + 1) * m] * weight
                out = part if out is None else out.add_(part)
        return out.double()
