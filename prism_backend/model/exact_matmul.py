"""The exact integer product X @ W on CPU, by whichever exact route is fastest here (on a GPU the
Triton-lang kernel kernels/triton/exact_gemm.py computes it; quant.py dispatches).

The int8 scheme (quant.py) multiplies integer activations X (M, K), |X| <= int_bound(P) for P
activation passes, by integer weights W (K, N), |W| <= int_bound(Q) for Q weight passes:
127 for one pass (plain int8), 8191 for two (13 bits), 127 * 128^2 for three. Passes are base-128
int8 digits (X = sum_i 128^(P-1-i) x_i, |x_0| <= 127, |x_i| <= 64). The product X @ W is an integer
matrix; every route below returns it exactly, as float64 (every value is below 2^53), so which route
runs can never change a bit:

  int_mm  the P * Q int8 x int8 -> int32 products of the passes by `torch._int_mm` (oneDNN: exact
          int32 sums, on AMX tiles where the CPU has them, vpdpbusd with VNNI), the activations'
          digits written by the kernel library's quantiser and the products combined in int64 and
          dequantised by its epilogue (kernels/cpu/exact_gemm.py DigitWeight; unfused torch passes
          where the library cannot load). On an Intel Xeon with AMX it is the fastest route for one
          pass a side and for a 13-bit down_proj.
  int16   without VNNI, int8 arithmetic runs at the float32 FMA rate (and `torch._int_mm` is a plain
          loop, 29x slower than an fp32 GEMM on an AVX2 EPYC). AVX2's vpmaddwd multiplies int16
          pairs at that same rate, so kernels/cpu/exact_gemm.py multiplies 13-bit x 13-bit integers
          in one product, int32 sums over runs of K that cannot overflow widened to float64: about
          one float32 GEMM's time (bench/gemm_routes.py), with the dequantisation fused in. This is
          why two passes mean 13 bits: 2 * 16 * 8191^2 < 2^31, so int32 lanes sum 32 products even
          at the bounds (and runs of many such blocks where the rows' own values allow).
  vnni16  the int16 kernel's AVX-512 VNNI form (CPUs with AVX-512 VNNI): the same panels, operands,
          runs and epilogue, vpdpwssd adding two int16 products into each of 16 int32 lanes in one
          instruction. A 13-bit x 13-bit product in one 16-bit product, where the digit routes
          (`int_mm`) take four 8-bit ones.
  vnni8   one pass a side (|x|, |w| <= 127) on CPUs with AVX-512 VNNI: the same library's 8-bit
          kernel, vpdpbusd on the activations + 128 (its unsigned operand) and the int8 weights, the
          zero point's column sums subtracted; int32 lanes that cannot overflow for K < 66,000, with
          the same fused quantisation and epilogue. 2.3-2.6x faster than `int16` on one layer's
          projections (VNNI EPYC), and the route that makes the 1+1 rung of the precision ladder fast.
  amx8    one pass a side on CPUs with Intel's AMX int8 tiles (Sapphire / Emerald Rapids Xeons): the
          8-bit kernel's operands and epilogue, its products by tdpbusd on 16 x 64 tiles (16 x 16 x 64
          products per instruction); the same exact int32 sums. On an Intel Xeon with AMX it runs
          gate_up at 900 rows 2.0x faster than `vnni8` and level with the bare `torch._int_mm`.
  amx_digits  integers of one or two base-128 digits a side (up to 13 bits) on the same AMX tiles:
          tdpbssd on the digits, the products of equal weight 128^e summed in their own int32 tile
          (three for 13 x 13 bits), combined exactly in float64 in the epilogue. On the Intel Xeon
          with AMX, 13-bit gate_up at 900 rows ~4x faster than `int16` and down ~1.3x than `int_mm`.
  float   where the int16 kernel cannot be built (no g++, no AVX2) or the integers do not fit
          int16 (three activation passes): an IEEE GEMM of the integer values, exact whenever every
          partial sum stays an integer the format represents, whatever order it adds in:
          - one pass each side (|x|, |w| <= 127): float32, K cut into chunks of at most 1,040
            (1040 * 127^2 < 2^24), each chunk's exact result summed in float64;
          - more passes: one float64 GEMM (|X W| <= 2080768 * 8191 * K < 2^53 for K below 500,000).

The route is chosen once per process, pass counts and weight shape, by timing every route that can
run here on that projection and taking the fastest. On an AVX2 CPU without VNNI that is `int16`. On
an AVX-512 VNNI EPYC it was `int16` for two passes and `vnni8` for one pass a side (oneDNN's int8
products there are no faster than `vnni8`, and the unfused `int_mm` made one layer's 13-bit
projections 3.6x slower than fp32, bench/isa_peak.py). On an Intel Xeon with AMX the engine chose
`amx8` or `amx_digits` for one pass a side and `amx_digits` for 13 bits (bench/forward_profile.py
prints the routes it chose), `int_mm` coming close on the smaller shapes.
Timing noise can only pick a slower route, never other bits.
PRISM_EXACT_ROUTE (older name: PRISM_INT8_ROUTE, still read) forces one route for every pass count
(tests, benchmarks).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Callable

import torch

from kernels.cpu import exact_gemm
from kernels.cpu.prologues import Prologue, Rotary

from .layers import apply_prologue, library_runs_prologue

EXACT_FP32_K = 1040  # 1040 * 127 * 127 = 16,774,160 < 2^24 = 16,777,216
PASS_BASE = exact_gemm.DIGIT_BASE  # base-128 digits: X = sum_i 128^(P-1-i) x_i, |x_0| <= 127, |x_i| <= 64
BOUNDS = {1: 127, 2: 8191, 3: 127 * PASS_BASE**2}
ROUTES = ("int_mm", "int16", "vnni16", "vnni8", "amx8", "amx_digits", "float")
# the variable that forces a route, and its older name (read where the new one is not set)
ROUTE_VARIABLE, OLD_ROUTE_VARIABLE = "PRISM_EXACT_ROUTE", "PRISM_INT8_ROUTE"
_route: str | None = None  # a forced route (PRISM_EXACT_ROUTE, tests) for every pass count, or None
_fastest: dict[tuple[int, int, int, int], str] = {}  # (act_passes, weight_passes, K, N) -> the fastest route here


def int_bound(passes: int) -> int:
    """The largest |integer| of a `passes`-pass quantisation: 127, 8191 (13 bits), 2080768."""
    return BOUNDS[passes]


def symmetric_scale(amax: torch.Tensor, bound: int) -> torch.Tensor:
    """Per-row (or per-channel) scale amax / bound; an all-zero row gets scale 1 (its integers are
    all 0 anyway) instead of a division by 0."""
    return torch.where(amax > 0, amax / bound, torch.ones_like(amax))


def round_to_grid(x: torch.Tensor, scale: torch.Tensor, bound: int) -> torch.Tensor:
    """x / scale rounded to integers (half to even), kept as float32 (exact below 2^24). The clamp
    only guards the last-bit rounding of the scale itself."""
    return torch.div(x, scale).round_().clamp_(-bound, bound)


def quantize_rows(x: torch.Tensor, bound: int, reduce_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> its symmetric per-row integers |X| <= bound (M, K) as float32 and the
    row scales (M, 1). reduce_max: an in-place all-reduce of the row maxima (tensor parallelism)."""
    amax = x.abs().amax(dim=1, keepdim=True)  # (M, 1)
    if reduce_max is not None:
        reduce_max(amax)
    scale = symmetric_scale(amax, bound)
    return round_to_grid(x, scale, bound), scale


def int8_passes(x: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """Integer-valued float tensor, |x| <= int_bound(passes) -> its base-128 digits as int8 tensors,
    most significant first (|first| <= 127, |others| <= 64). All steps are exact in float32."""
    return exact_gemm.split_digits(x, passes)


ROUNDS = 5  # timed calls per route, one per round, after a warm-up call


def _time(fn) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fastest_route(calls: dict[str, Callable[[], object]]) -> str:
    """The name of the fastest of `calls` (route -> the served projection on that route): each
    called once to warm up, then once per round, the routes interleaved within every round, each
    keeping its fastest call. On a shared machine noise only ever adds time, so the minimum is the
    estimate a burst cannot inflate; and interleaving spreads a burst that lasts longer than a call
    -- another process starting, as Triton's other stubs do while the decision model builds -- over
    every route, where timing the routes one after another once let it fall on one route alone
    (the 8-bit gate_up then went to `int_mm`, 1.9x slower, for a whole server's life). A route is
    dropped once one of its calls takes over five times the best so far, or its warm-up over twenty
    times the fastest warm-up (a first call may pay one-off setup, such as oneDNN building its
    kernel; without VNNI `torch._int_mm` is a plain loop, ~30x an fp32 GEMM, and timing it in full
    at every start cost a few hundred ms)."""
    warm = {name: _time(fn) for name, fn in calls.items()}
    fastest_warm = min(warm.values())
    best = {name: math.inf for name in calls if warm[name] <= 20 * fastest_warm}
    for _ in range(ROUNDS):
        for name in list(best):
            elapsed, leader = _time(calls[name]), min(best.values())
            if elapsed > 5 * leader and best[name] > leader:  # the leader itself is never dropped
                del best[name]
            else:
                best[name] = min(best[name], elapsed)
    return min(best, key=best.get)


def _forced_variable() -> tuple[str, str] | None:
    """(the variable's name, the route it names) where PRISM_EXACT_ROUTE or its older name
    PRISM_INT8_ROUTE is set (both set: they must agree), else None."""
    given = {name: os.environ[name] for name in (ROUTE_VARIABLE, OLD_ROUTE_VARIABLE) if os.environ.get(name, "")}
    if len(set(given.values())) > 1:
        raise ValueError(f"{ROUTE_VARIABLE}={given[ROUTE_VARIABLE]!r} and {OLD_ROUTE_VARIABLE}="
                         f"{given[OLD_ROUTE_VARIABLE]!r} disagree; set only {ROUTE_VARIABLE}")
    return next(iter(given.items()), None)


def _forced() -> str | None:
    global _route
    if _route is None and (variable := _forced_variable()) is not None:
        name, forced = variable
        if forced not in ROUTES:
            raise ValueError(f"{name} must be one of {ROUTES}, got {forced!r}")
        if forced == "int16" and exact_gemm.load() is None:
            raise RuntimeError(f"{name}=int16: {exact_gemm.why_not()}")
        if forced in ("vnni8", "vnni16") and not exact_gemm.vnni8_available():
            raise RuntimeError(f"{name}={forced}: needs the kernel library and a CPU with AVX-512 VNNI")
        if forced in ("amx8", "amx_digits") and not exact_gemm.amx8_available():
            raise RuntimeError(f"{name}={forced}: needs the kernel library and a CPU with AMX int8 tiles")
        _route = forced
    return _route


def route(act_passes: int = 2, weight_passes: int = 2, shape: tuple[int, int] = (576, 1536)) -> str:
    """The CPU route of this process for a (K, N) = `shape` weight of integers of these pass counts
    (see the module docstring): the fastest at the served projection (quantise, multiply, dequantise:
    ExactWeight.linear) on 512 rows, timed once per pass counts and shape (~0.1 s each), the routes
    interleaved and a route's timing cut short once it cannot win (_fastest_route). Per shape,
    because the winner depends on it: on an Intel Xeon with AMX, `int_mm` runs a 13-bit down_proj (1536, 576) 2.4x faster than `int16` but a 13-bit
    gate_up (576, 3072) 1.3x slower (its four int32 digit products outgrow the caches). Timing the
    bare product instead of the served projection let the unfused `int_mm` win now and then."""
    forced = _forced()
    if forced is not None:
        return forced
    k, n = shape
    key = (act_passes, weight_passes, k, n)
    if key not in _fastest:
        gen = torch.Generator().manual_seed(0)
        x_bound, w_bound = int_bound(act_passes), int_bound(weight_passes)
        # 512 rows: long enough (~1-3 ms for SmolLM2's projections) that thread wake-ups and
        # scheduling jitter cannot reorder routes that differ by 2x (128 rows, ~0.2-0.4 ms, did)
        x = torch.randn(512, k, generator=gen)  # activations, quantised as served
        w = torch.randint(-w_bound, w_bound + 1, (k, n), generator=gen).float()
        w_scale = torch.full((n,), 1e-3)
        weights = {r: ExactWeight(w, act_passes, weight_passes, chosen=r)
                   for r in ROUTES if runs_here(r, x_bound, w_bound)}
        _fastest[key] = _fastest_route({r: functools.partial(weight.linear, x, w_scale, None)
                                        for r, weight in weights.items()})
    return _fastest[key]


@contextlib.contextmanager
def timings_forgotten():
    """Routes chosen inside are forgotten on leaving (those chosen before are kept): for a phase whose
    timings do not speak for serving. The int8 calibration times the 8-bit routes right after GPTQ's
    worker threads, whose OpenMP teams still spin for a while: on the Intel Xeon with AMX a cold
    build once chose `amx_digits` for gate_up there, 2.3x `amx8`'s time (2026-12-05), and the served
    model would have kept it. Any route gives the same integers, so only the speed was at stake."""
    before = dict(_fastest)
    try:
        yield
    finally:
        _fastest.clear()
        _fastest.update(before)


def chosen_routes() -> dict[tuple[int, int, int, int], str]:
    """The routes this process has chosen so far: (act_passes, weight_passes, K, N) -> route."""
    return dict(_fastest)


def describe_chosen_routes() -> str:
    """chosen_routes() for a log line or a results page: '2+2 576x960 vnni16, ...' ('' if none)."""
    return ", ".join(f"{p}+{q} {k}x{n} {r}" for (p, q, k, n), r in sorted(_fastest.items()))


def runs_here(route_name: str, x_bound: int, w_bound: int) -> bool:
    """Whether `route_name` can multiply integers of these bounds on this machine: int16 where its
    library loads and they fit int16, vnni16 for them on AVX-512 VNNI CPUs, vnni8 for 8-bit integers
    there, amx8 for them on CPUs with AMX int8 tiles, amx_digits there for integers of up to two digits (13 bits), the rest always."""
    if route_name == "int16":
        return exact_gemm.load() is not None and exact_gemm.fits(x_bound, w_bound)
    if route_name == "vnni16":
        return exact_gemm.fits(x_bound, w_bound) and exact_gemm.vnni8_available()
    if route_name == "vnni8":
        return exact_gemm.fits8(x_bound, w_bound) and exact_gemm.vnni8_available()
    if route_name == "amx8":
        return exact_gemm.fits8(x_bound, w_bound) and exact_gemm.amx8_available()
    if route_name == "amx_digits":
        return max(x_bound, w_bound) <= BOUNDS[exact_gemm.AmxDigitWeight.MAX_PASSES] and exact_gemm.amx8_available()
    return True


class ExactWeight:
    """An integer weight W (K, N), prepared for one route: int8 digits for `int_mm` (and for the
    Triton-lang kernel), int16 panels for `int16` and `vnni16`, float32 K-chunks (one pass each side) or a float64
    copy for `float`."""

    def __init__(self, w_int: torch.Tensor, act_passes: int, weight_passes: int, chosen: str | None = None,
                 glu: bool = False):
        """w_int: (K, N) integer-valued float32, |w_int| <= int_bound(weight_passes). glu: W is gate_proj
        and up_proj side by side (gate first); where the route is the 8-bit VNNI kernel and N a multiple
        of 32, it is packed so the kernel can end in SwiGLU (`fuses_swiglu`, linear(swiglu=True))."""
        self.act_passes, self.weight_passes = act_passes, weight_passes
        self.x_bound, self.w_bound = int_bound(act_passes), int_bound(weight_passes)
        self.route = chosen or (route(act_passes, weight_passes, tuple(w_int.shape)) if not w_int.is_cuda else "int_mm")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {self.route!r}")
        if self.route in ("vnni8", "amx8") and not exact_gemm.fits8(self.x_bound, self.w_bound, w_int.shape[0]):
            self.route = "int16"  # a forced route for more than one pass: the next exact kernel
        if self.route == "amx_digits" and max(act_passes, weight_passes) > exact_gemm.AmxDigitWeight.MAX_PASSES:
            self.route = "int_mm"  # a forced route for three passes: the exact route for any digits
        if self.route in ("int16", "vnni16") and not exact_gemm.fits(self.x_bound, self.w_bound):
            self.route = "float"  # three activation passes: integers beyond int16
        self.digits = None  # (K, N) int8 each, most significant first: int_mm and the Triton-lang kernel
        # the weight of a kernel that also quantises and dequantises (int16 / vnni16, vnni8 / amx8, amx_digits,
        # or int_mm with the kernel library's quantiser and epilogue), or None
        self.fused = self.fp32_chunks = self.fp64 = None
        self.fuses_swiglu = False  # whether linear(swiglu=True) runs (the 8-bit kernel's SwiGLU epilogue)
        self.fuses_rotary = False  # whether linear(rotary=...) runs (the VNNI tiles' rotary epilogue)
        if self.route == "int_mm":
            self.digits = int8_passes(w_int, weight_passes)
            if not w_int.is_cuda and exact_gemm.load() is not None:
                self.fused = exact_gemm.DigitWeight(self.digits, act_passes)
        elif self.route == "amx_digits":  # the panels only; int8_digits() remakes the digits if asked
            self.fused = exact_gemm.AmxDigitWeight(int8_passes(w_int, weight_passes), act_passes)
        elif self.route in ("int16", "vnni16"):
            self.fused = exact_gemm.PackedWeight(w_int, self.w_bound, vnni=self.route == "vnni16")
            self.fuses_rotary = self.route == "vnni16"
        elif self.route in ("vnni8", "amx8"):
            self.fuses_swiglu = glu and w_int.shape[1] % (2 * exact_gemm.GLU_COLUMNS) == 0
            self.fused = exact_gemm.PackedWeight8(w_int, amx=self.route == "amx8", glu=self.fuses_swiglu)
            self.fuses_rotary = self.route == "vnni8" and not self.fuses_swiglu
        elif act_passes == weight_passes == 1:
            self.fp32_chunks = [c.float() for c in w_int.split(EXACT_FP32_K)]  # (<= 1040, N) float32
        else:
            self.fp64 = w_int.double()  # (K, N) float64

    def int8_digits(self) -> list[torch.Tensor]:
        """W's int8 passes (the Triton-lang kernel's operands), made from this route's copy on first use."""
        if self.digits is None:
            if self.fused is not None:
                w_int = self.fused.unpacked().float()
            else:
                w_int = self.fp64.float() if self.fp64 is not None else torch.cat(self.fp32_chunks)
            self.digits = int8_passes(w_int, self.weight_passes)
        return self.digits

    def linear(self, x: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None, prologue: Prologue = None, swiglu: bool = False,
               rotary: Rotary | None = None, split: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The served projection on one rank: x (M, K) float32 quantised per row to |X| <= x_bound,
        X @ W exactly, dequantised ((X @ W) * x_scale) * w_scale, rounded once, + bias (N,) (+ residual
        (M, N), last) -> (M, N) float32. A kernel with fused quantisation and epilogue does it in one
        library call (the same operations); route() times exactly this. prologue: x is the input of
        that row pass (RMSNorm, SwiGLU), which the kernel's quantiser runs in its own pass. swiglu
        (where fuses_swiglu): -> (M, N / 2), silu(gate) * up of that output in the kernel's epilogue. rotary
        (where fuses_rotary): its columns' heads get the rotary embedding in the kernel's epilogue; split
        (with rotary): -> (columns [0, split), columns [split, N)), each in its own storage."""
        if swiglu and not self.fuses_swiglu:
            raise ValueError("this weight's kernel has no SwiGLU epilogue (fuses_swiglu is False)")
        if rotary is not None and not self.fuses_rotary:
            raise ValueError("this weight's kernel has no rotary epilogue (fuses_rotary is False)")
        if self.fused is not None and not library_runs_prologue(prologue):
            x, prologue = apply_prologue(prologue, x), None
        if self.fused is not None:
            # (M, K padded) int16 / uint8, (M, 1)
            x_kernel, x_scale = self.fused.quantize(x, self.x_bound, prologue=prologue)
            if swiglu:
                return self.fused.matmul(x_kernel, self.x_bound, x_scale, w_scale, bias, swiglu=True)
            if rotary is not None:
                return self.fused.matmul(x_kernel, self.x_bound, x_scale, w_scale, bias, residual, rotary=rotary,
                                         split=split)
            return self.fused.matmul(x_kernel, self.x_bound, x_scale, w_scale, bias, residual)
        x_int, x_scale = quantize_rows(apply_prologue(prologue, x), self.x_bound)  # (M, K), (M, 1)
        out = dequantize(self.matmul(x_int), x_scale, w_scale, bias)
        return out if residual is None else out.add_(residual)

    def matmul(self, x_int: torch.Tensor) -> torch.Tensor:
        """x_int: (M, K) integer-valued float32, |x_int| <= int_bound(act_passes) -> (M, N) float64,
        exactly x_int @ w_int."""
        if self.fused is not None:
            return self.fused.matmul(x_int, self.x_bound)
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


def dequantize(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """acc (M, N) float64 exact integers -> float32 (acc * x_scale) * w_scale, rounded once, + bias
    (the int16 kernel's fused epilogue does the same operations)."""
    out = acc.mul_(x_scale.double()).mul_(w_scale.double()).float()
    return out if bias is None else out.add_(bias)
