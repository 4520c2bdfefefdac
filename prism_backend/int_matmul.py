"""Exact int8 x int8 -> int32 matrix products on CPU, by whichever exact route is faster here.

`torch._int_mm` is exact, and on CPUs with VNNI (oneDNN's int8 kernels) it is the fastest product
torch has. Without VNNI (AVX2-only CPUs) torch falls back to a plain loop: measured on an AVX2 EPYC,
2.6 s for a (760, 576) x (576, 1536) product that an fp32 GEMM does in 0.13 s.

An fp32 GEMM of the int8 values is exact too: |x|, |w| <= 127, so one product is at most 16,129,
and any partial sum of at most 1,040 of them stays below 2^24 in magnitude. Every intermediate
value is then an integer that float32 represents exactly, whatever order the GEMM adds in, with or
without FMA. Longer K is cut into chunks of at most 1,040 rows, each chunk's exact result
converted to int32 and the chunks summed in int32.

Both routes return the same int32 values, so which one runs can never change a bit: it is chosen
by timing both once per process (or forced with PRISM_INT8_ROUTE=int_mm|fp32, for tests).
"""
from __future__ import annotations

import os
import time

import torch

EXACT_FP32_K = 1040  # 1040 * 127 * 127 = 16,774,160 < 2^24 = 16,777,216
ROUTES = ("int_mm", "fp32")
_route: str | None = None


def _time(fn, repeats: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return time.perf_counter() - start


def route() -> str:
    """The CPU route of this process: PRISM_INT8_ROUTE if set, else the faster one on a
    SmolLM2-sized product (timed once, ~0.1 s with VNNI, ~1 s without)."""
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
            w = ExactWeight(torch.randint(-127, 128, (576, 512), dtype=torch.int8, generator=gen), "fp32")
            int_mm = _time(lambda: torch._int_mm(x, w.int8))
            fp32 = _time(lambda: w.matmul(x))
            _route = "int_mm" if int_mm <= fp32 else "fp32"
    return _route


class ExactWeight:
    """An int8 (K, N) weight, prepared for the CPU route: the fp32 route keeps float32 copies of
    its K chunks (4x the int8 memory) so that no product converts the weight again."""

    def __init__(self, w_q: torch.Tensor, chosen: str | None = None):
        self.int8 = w_q  # (K, N) int8, what torch._int_mm and the Triton-lang kernel take
        self.route = chosen or (route() if not w_q.is_cuda else "int_mm")
        self.chunks = None
        if self.route == "fp32":
            self.chunks = [c.float() for c in w_q.split(EXACT_FP32_K)]  # (<= 1040, N) float32 each

    def matmul(self, x_q: torch.Tensor) -> torch.Tensor:
        """x_q: (M, K) int8 -> (M, N) int32, exactly x_q @ w_q."""
        if self.chunks is None:
            return torch._int_mm(x_q, self.int8)
        x = x_q.float()
        out, start = None, 0
        for chunk in self.chunks:
            part = torch.mm(x[:, start : start + chunk.shape[0]], chunk).to(torch.int32)
            out = part if out is None else out.add_(part)
            start += chunk.shape[0]
        return out
