"""How close the projections run to the CPU's instruction peak.

    .venv/bin/python bench/isa_peak.py [--threads 2]

Measures (a) the peak of the instructions each product is made of (bench/csrc/isa_peak.cpp,
compiled here with g++): fp32 FMA for sgemm, vpmaddwd + vpaddd for Prism's int16 kernel, vpdpbusd
for its 8-bit kernel (AVX-512 VNNI CPUs only); and (b) what one decoder layer's four projections
achieve at 760 rows with decoder-like activations (normal values with a few outlier channels,
quantised per row): fp32 `F.linear` (MKL), the default's served int8 path (13 x 13 bits: quantise,
multiply, dequantise, Int8Linear's call) and the 1+1 rung's (8 x 8 bits). Reports Gop/s (a multiply-
add is 2 ops) and each product's share of its instruction's peak. Writes bench/results/isa_peak.md.
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

from kernels.cpu.features import has_avx512_vnni  # noqa: E402
from prism_backend.config import ComputeSettings  # noqa: E402
from prism_backend.model.quant import Int8Linear  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "csrc" / "isa_peak.cpp"
FMA, MADD, DPBUSD = "fp32 FMA (vfmadd231ps)", "int16 vpmaddwd + vpaddd", "int8 vpdpbusd zmm (AVX-512 VNNI)"
LOOPS = {FMA: ("fma_peak", 12 * 16), MADD: ("madd_peak", 12 * 32), DPBUSD: ("dpbusd_peak", 12 * 128)}


def peak_library():
    out = Path(tempfile.mkdtemp()) / "isa_peak.so"
    subprocess.run(["g++", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-o", str(out), str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, _ in LOOPS.values():  # dpbusd_peak is compiled everywhere (a target attribute), run only with VNNI
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = peak_library()
    loops = {k: v for k, v in LOOPS.items() if k != DPBUSD or has_avx512_vnni()}
    peaks = {label: peak_gops(getattr(lib, name), ops, args.threads) for label, (name, ops) in loops.items()}

    gen = torch.Generator().manual_seed(0)
    default = ComputeSettings(precision="int8", act_passes=2, weight_passes=2)
    fast = ComputeSettings(precision="int8", act_passes=1, weight_passes=1)
    layer = []  # (x, fp32 weight, the default's Int8Linear, the 1+1 rung's) per projection
    for k, n in SHAPES.values():
        w = torch.randn(n, k, generator=gen) / k**0.5
        layer.append((decoder_like(ROWS, k, gen), w, Int8Linear(w, None, default), Int8Linear(w, None, fast)))
    ops = sum(2 * ROWS * w.shape[0] * w.shape[1] for _, w, _, _ in layer)
    routes = {"default": layer[0][2].w.route, "fast": layer[0][3].w.route}
    products = {  # label -> (one projection's call, the peak of the instruction it runs on)
        "fp32 F.linear": (lambda x, w, d, f: torch.nn.functional.linear(x, w), FMA),
        f"int8 2+2, the default (served Int8Linear, `{routes['default']}`)": (lambda x, w, d, f: d(x), MADD),
        f"int8 1+1 (served Int8Linear, `{routes['fast']}`)":
            (lambda x, w, d, f: f(x), DPBUSD if routes["fast"] == "vnni8" else MADD),
    }
    runs = {label: [] for label in products}
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
        for label, (call, _) in products.items():
            start = time.perf_counter()
            for x, w, d, f in layer:
                call(x, w, d, f)
            runs[label].append(time.perf_counter() - start)
    lines = ["# Projections vs instruction peak", "",
             f"`.venv/bin/python bench/isa_peak.py --threads {args.threads}`: peaks are the best of 5 loops "
             f"on {args.threads} thread(s); one layer's four projections (SmolLM2 shapes, {ROWS} rows, "
             f"decoder-like values), median of {args.repeats} interleaved runs; int8 routes as chosen by "
             "model/exact_matmul.py.", "",
             "| instruction | peak Gop/s |", "|---|---|"]
    lines += [f"| {label} | {gops:.1f} |" for label, gops in peaks.items()]
    lines += ["", "| product | ms per layer | Gop/s | share of its instruction's peak |", "|---|---|---|---|"]
    for label, times in runs.items():
        ms = 1000 * statistics.median(times)
        gops = ops / (ms / 1000) / 1e9
        peak = peaks[products[label][1]]
        lines.append(f"| {label} | {ms:.1f} | {gops:.1f} | {100 * gops / peak:.0f}% of {products[label][1]} |")
    write_result("isa_peak.md", lines)


if __name__ == "__main__":
    main()
