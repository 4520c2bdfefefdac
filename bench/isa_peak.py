"""How close the projections and attention run to the CPU's instruction peak.

    .venv/bin/python bench/isa_peak.py [--threads 2]

Measures (a) the peak of the instructions each product is made of (bench/csrc/isa_peak.cpp,
compiled here with g++): fp32 FMA on ymm (AVX2) and on zmm (AVX-512 CPUs: MKL's sgemm and Prism's
tree attention use zmm there), vpmaddwd + vpaddd for the int16 kernel, vpdpwssd for its AVX-512
VNNI form (vnni16), vpdpbusd for the 8-bit kernel (VNNI CPUs only); (b) what one decoder layer's
four projections achieve at 760 rows with decoder-like activations (normal values with a few outlier
channels, quantised per row): fp32 `F.linear` (MKL), the exact scheme's served 13-bit product
(2+2 passes: quantise, multiply, dequantise) and the 8-bit one's (1+1), each on the route
model/exact_matmul.py chooses; and (c) Prism's tree attention (kernels/cpu) on the forest of
workload (a) -- a 29-row system prompt, a 620-row ticket in 128-row blocks, three ~36-row questions
below it -- in SmolLM2's heads (9 query, 3 key/value heads of 64), counting only the products of
visible (query, key) pairs, in float32 and in its integer form, against torch's CPU flash-attention
kernel on the same segments. Reports Gop/s (a multiply-add is 2 ops) and each one's share of its
instruction's peak. Writes bench/results/isa_peak.md.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from gemm_routes import ROWS, SHAPES, decoder_like  # noqa: E402
from workloads import write_result  # noqa: E402

from kernels.cpu import tree_attention  # noqa: E402
from kernels.cpu.features import has_avx512, has_avx512_vnni, machine  # noqa: E402
from prism_backend.config import ComputeSettings  # noqa: E402
from prism_backend.model.attention import _expand_groups, _sdpa, visibility_mask  # noqa: E402
from prism_backend.model.quant import Int8Linear  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "csrc" / "isa_peak.cpp"
KERNEL_CSRC = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "csrc"  # accumulate.h: the kernels' asm steps
FMA, FMA512 = "fp32 FMA ymm (vfmadd231ps, AVX2)", "fp32 FMA zmm (vfmadd231ps, AVX-512)"
MADD, DPWSSD = "int16 vpmaddwd + vpaddd ymm", "int16 vpdpwssd zmm (AVX-512 VNNI)"
DPBUSD = "int8 vpdpbusd zmm (AVX-512 VNNI)"
LOOPS = {FMA: ("fma_peak", 12 * 16, None), FMA512: ("fma512_peak", 12 * 32, has_avx512),
         MADD: ("madd_peak", 12 * 32, None), DPWSSD: ("dpwssd_peak", 12 * 64, has_avx512_vnni),
         DPBUSD: ("dpbusd_peak", 12 * 128, has_avx512_vnni)}  # label: (function, ops per round, runs here?)
ROUTE_INSTRUCTION = {"int16": MADD, "vnni16": DPWSSD, "vnni8": DPBUSD}  # other routes: no single instruction
# workload (a)'s forest: (query rows, keys before its own rows) per segment, in order
FOREST_A = [(29, 0), (128, 29), (128, 157), (128, 285), (128, 413), (107, 541), (34, 648), (36, 648), (38, 648)]


def peak_library():
    out = Path(tempfile.mkdtemp()) / "isa_peak.so"
    subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-I", str(KERNEL_CSRC), "-o", str(out),
                    str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, _, _ in LOOPS.values():
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_double, [ctypes.c_long]
    return lib


def peak_gops(fn, ops_per_round: int, threads: int, rounds: int = 20_000_000) -> float:
    """One loop per thread (ctypes releases the GIL), all at once; the best of 5."""
    best = 0.0
    for _ in range(5):
        workers = [threading.Thread(target=fn, args=(rounds,)) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * rounds * ops_per_round / (time.perf_counter() - start) / 1e9)
    return best


def forest_a(gen: torch.Generator):
    """Tree attention's inputs for workload (a)'s forest (random values of a decoder's scale), the
    ops of its visible (query, key) pairs (q·k and p·v, 2 x 64 multiply-adds each, per query head),
    and its segments as (first row, rows, key rows, keys before its own)."""
    heads, kv_heads, d = 9, 3, 64
    rows = sum(q_len for q_len, _ in FOREST_A)
    q, k, v = (torch.randn(rows, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    segments, ops, start = [], 0, 0
    for q_len, prefix in FOREST_A:
        # a question sees the system prompt and ticket before it, then its own rows; a block of the
        # ticket sees every row up to its own end
        own = torch.arange(start, start + q_len)
        keys = torch.cat([torch.arange(prefix), own]) if prefix < start else torch.arange(start + q_len)
        segments.append((start, q_len, keys, prefix))
        ops += 2 * 2 * d * heads * sum(prefix + r + 1 for r in range(q_len))
        start += q_len
    key_rows, table = tree_attention.segment_table(segments)
    return (q, k, v, key_rows, table), ops, segments


def torch_forest_attention(q, k, v, segments) -> torch.Tensor:
    """The same forest through torch's CPU flash-attention kernel, segment by segment, as
    model/attention.py runs it with `kernels` torch (GQA groups expanded once per layer)."""
    k, v = _expand_groups(k, v, q.shape[1])
    out = torch.empty_like(q)
    for start, rows, keys, prefix in segments:
        mask = visibility_mask(rows, keys.numel(), prefix) if rows > 1 and prefix > 0 else None
        out[start:start + rows] = _sdpa(q[start:start + rows], k[keys], v[keys], prefix, causal=True, mask=mask)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = peak_library()
    peaks = {label: peak_gops(getattr(lib, name), ops, args.threads)
             for label, (name, ops, runs_here) in LOOPS.items() if runs_here is None or runs_here()}
    fma = FMA512 if FMA512 in peaks else FMA

    gen = torch.Generator().manual_seed(0)
    exact = ComputeSettings(precision="exact", act_passes=2, weight_passes=2)
    eight = ComputeSettings(precision="exact", act_passes=1, weight_passes=1)
    layer = []  # (x, fp32 weight, the exact scheme's Int8Linear, the 8-bit one's) per projection
    for k, n in SHAPES.values():
        w = torch.randn(n, k, generator=gen) / k**0.5
        layer.append((decoder_like(ROWS, k, gen), w, Int8Linear(w, None, exact), Int8Linear(w, None, eight)))
    ops = {"projections": sum(2 * ROWS * w.shape[0] * w.shape[1] for _, w, _, _ in layer)}
    routes = {"exact": layer[0][2].w.route, "eight": layer[0][3].w.route}
    products = {  # label -> (one call, the peak of the instruction it runs on, what it computes)
        "fp32 F.linear (MKL)": (lambda: [torch.nn.functional.linear(x, w) for x, w, _, _ in layer], fma, "projections"),
        f"13-bit, 2+2 passes (served Int8Linear, `{routes['exact']}`)":
            (lambda: [e(x) for x, _, e, _ in layer], ROUTE_INSTRUCTION.get(routes["exact"]), "projections"),
        f"8-bit, 1+1 (served Int8Linear, `{routes['eight']}`)":  # int_mm: oneDNN's u8s8 GEMM, vpdpbusd on VNNI
            (lambda: [f(x) for x, _, _, f in layer], DPBUSD if routes["eight"] == "int_mm" and DPBUSD in peaks
             else ROUTE_INSTRUCTION.get(routes["eight"]), "projections"),
    }
    if tree_attention.available(64):
        inputs, ops["attention"], segments = forest_a(gen)
        products["tree attention, torch's flash-attention kernel (kernels torch)"] = (
            lambda: torch_forest_attention(*inputs[:3], segments), fma, "attention")
        products["tree attention, fp32 (kernels/cpu)"] = (lambda: tree_attention.tree_attention(*inputs), fma,
                                                           "attention")
        # the integer form (14-bit q, k, 12-bit v, 15-bit weights, exact int32 sums): vpdpwssd where the CPU has
        # VNNI, else vpmaddwd + vpaddd
        products["tree attention, integers (kernels/cpu)"] = (
            lambda: tree_attention.tree_attention(*inputs, integer=True),
            DPWSSD if DPWSSD in peaks else MADD, "attention")
    runs = {label: [] for label in products}
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
        for label, (call, _, _) in products.items():
            start = time.perf_counter()
            call()
            runs[label].append(time.perf_counter() - start)
    lines = ["# Projections and attention vs instruction peak", "",
             f"`.venv/bin/python bench/isa_peak.py --threads {args.threads}`, {time.strftime('%Y-%m-%d')}, "
             f"{machine()}: peaks are the best of 5 loops on {args.threads} thread(s); one layer's four "
             f"projections (SmolLM2 shapes, {ROWS} rows, decoder-like values) and one layer's tree attention "
             f"on workload (a)'s forest ({sum(q for q, _ in FOREST_A)} rows, visible pairs only), median of "
             f"{args.repeats} interleaved runs; routes as chosen by model/exact_matmul.py.", "",
             "| instruction | peak Gop/s |", "|---|---|"]
    lines += [f"| {label} | {gops:.1f} |" for label, gops in peaks.items()]
    lines += ["", "| product | ms per layer | Gop/s | share of its instruction's peak |", "|---|---|---|---|"]
    for label, times in runs.items():
        ms = 1000 * statistics.median(times)
        _, instruction, work = products[label]
        gops = ops[work] / (ms / 1000) / 1e9
        share = f"{100 * gops / peaks[instruction]:.0f}% of {instruction}" if instruction else "(no single instruction)"
        lines.append(f"| {label} | {ms:.2f} | {gops:.1f} | {share} |")
    write_result("isa_peak.md", lines)


if __name__ == "__main__":
    main()
