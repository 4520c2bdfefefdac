"""What one projection costs by each exact integer route on this CPU, next to a plain fp32 GEMM.

    .venv/bin/python bench/gemm_routes.py [--threads 2]

SmolLM2-135M's projection shapes at 760 rows (workload a's forest): for each, the median time of
  fp32 sgemm          the fp32 path's product (not batch-invariant: MKL may pick its kernel by M)
  bf16 mm             a bf16 GEMM (oneDNN: the CPU's bf16 dot instructions, or AMX tiles on Intel
                      Xeons that have them): vLLM's product on these CPUs, not exact
  int8 _int_mm        one int8 x int8 -> int32 product (oneDNN, on AMX tiles where the CPU has them;
                      a plain loop without VNNI, timed once there)
  fbgemm u8s8         one int8 product by FBGEMM's AVX2 kernel (vpmaddubsw), exact only while
                      |w| <= 64 (its int16 pair sums saturate beyond); shown as the CPU's int8 rate
  exact 1+1 (fp32)    one pass each side: an fp32 GEMM of the int8 values, K-chunks <= 1,040
  exact 1+1 (vnni8)   the same integers by Prism's 8-bit VNNI kernel (AVX-512 VNNI CPUs only)
  exact 1+1 (amx8)    the same by its AMX variant (CPUs with AMX int8 tiles only)
  exact 2+2 (int16)   two passes each side (the default, 13-bit integers) by the AVX2 int16 kernel
                      (kernels/cpu/exact_gemm.py): the route Prism takes on CPUs without VNNI; on
                      uniform random integers (its int32 runs then end every 16 k-pairs, the worst
                      case) and on decoder-like ones (normal values, a few outlier channels)
  exact 2+2 (vnni16)  the same by the int16 kernel's AVX-512 VNNI form (vpdpwssd; AVX-512 VNNI CPUs
                      only), uniform and decoder-like
  exact 2+2 (amx_digits)  the same 13-bit integers as base-128 digits on AMX tiles (AMX CPUs only)
  exact 2+2 (int_mm)  the same digits by four torch._int_mm products, combined by the library
  exact 2+2 (fp64)    the same integers by one float64 GEMM (the route without the int16 kernel)
  old default         the scheme before 2026-11-30: three exact fp32 products per projection
and writes bench/results/gemm_routes.md. Without VNNI an int8 product costs what an fp32 one does
(FBGEMM's row), so an exact path cannot undercut fp32 there by doing int8 arithmetic; what it can do
is one product per projection at the fp32 rate, which vpmaddwd on 13-bit integers gives.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from workloads import write_result  # noqa: E402

from kernels.cpu import exact_gemm  # noqa: E402
from kernels.cpu.features import has_avx512_vnni, machine  # noqa: E402
from prism_backend.model.exact_matmul import ExactWeight, int_bound  # noqa: E402

ROWS = 760
SHAPES = {"qkv (576 -> 960)": (576, 960), "o (576 -> 576)": (576, 576), "gate_up (576 -> 3072)": (576, 3072),
          "down (1536 -> 576)": (1536, 576)}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def decoder_like(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, k) float32 activations shaped like a decoder's: normal values, 4 outlier channels x20."""
    x = torch.randn(rows, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:4]] *= 20
    return x


def fbgemm_product(x_int8: torch.Tensor, w_small: torch.Tensor):
    """FBGEMM's exact u8s8 product of int8 activations (+128 zero point) and |w| <= 64 weights, or
    None where this torch has no FBGEMM."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    torch.backends.quantized.engine = "fbgemm"
    n = w_small.shape[1]
    qw = torch.quantize_per_channel(w_small.t().float().contiguous(), torch.ones(n, dtype=torch.double),
                                    torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    xf = x_int8.float()
    return lambda: torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xf, 1.0, 128, packed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        x8 = torch.randint(-127, 128, (ROWS, k), dtype=torch.int8, generator=gen)
        w8 = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
        xf, wf = x8.float(), w8.float()
        x2 = torch.randint(-int_bound(2), int_bound(2) + 1, (ROWS, k), generator=gen).float()
        w2 = torch.randint(-int_bound(2), int_bound(2) + 1, (k, n), generator=gen).float()
        one, two = ExactWeight(wf, 1, 1, "float"), ExactWeight(w2, 2, 2, "float")
        one8 = ExactWeight(wf, 1, 1, "vnni8") if exact_gemm.vnni8_available() else None
        xb, wb = xf.bfloat16(), wf.bfloat16()
        two16 = ExactWeight(w2, 2, 2, "int16")
        two_vnni = exact_gemm.vnni8_available()  # the int16 kernel's VNNI form runs where the 8-bit one does
        one_amx = ExactWeight(wf, 1, 1, "amx8") if exact_gemm.amx8_available() else None
        two_amx = ExactWeight(w2, 2, 2, "amx_digits") if exact_gemm.amx8_available() else None
        two_int_mm = ExactWeight(w2, 2, 2, "int_mm")
        # decoder-like 13-bit integers: normal activations with a few outlier channels, quantised
        # per row, and weights per column (the int16 kernel's int32 runs are then many blocks long)
        x_real = decoder_like(ROWS, k, gen)
        x2r = (x_real / x_real.abs().amax(dim=1, keepdim=True) * int_bound(2)).round()
        w_real = torch.randn(k, n, generator=gen)
        w2r = (w_real / w_real.abs().amax(dim=0) * int_bound(2)).round()
        two16r = ExactWeight(w2r, 2, 2, "int16")
        vnni16 = ExactWeight(w2, 2, 2, "vnni16") if two_vnni else None
        vnni16r = ExactWeight(w2r, 2, 2, "vnni16") if two_vnni else None
        x_old = torch.cat([xf, xf])  # the old default: two activation passes stacked ...
        fb = fbgemm_product(x8, torch.randint(-64, 65, (k, n), dtype=torch.int8, generator=gen))
        times = {
            "fp32 sgemm": median_ms(lambda: torch.mm(xf, wf), args.repeats),
            "bf16 mm": median_ms(lambda: torch.mm(xb, wb), args.repeats),
            "int8 _int_mm": median_ms(lambda: torch._int_mm(x8, w8), args.repeats if has_avx512_vnni() else 1),
            "fbgemm u8s8": median_ms(fb, args.repeats) if fb else float("nan"),
            "exact 1+1 (fp32)": median_ms(lambda: one.matmul(xf), args.repeats),
            "exact 1+1 (vnni8)": median_ms(lambda: one8.matmul(xf), args.repeats) if one8 else float("nan"),
            "exact 1+1 (amx8)": median_ms(lambda: one_amx.matmul(xf), args.repeats) if one_amx else float("nan"),
            "exact 2+2 (int16, uniform)": median_ms(lambda: two16.matmul(x2), args.repeats),
            "exact 2+2 (vnni16, uniform)": (median_ms(lambda: vnni16.matmul(x2), args.repeats) if vnni16
                                            else float("nan")),
            "exact 2+2 (vnni16, decoder-like)": (median_ms(lambda: vnni16r.matmul(x2r), args.repeats) if vnni16r
                                                 else float("nan")),
            "exact 2+2 (amx_digits)": median_ms(lambda: two_amx.matmul(x2), args.repeats) if two_amx else float("nan"),
            "exact 2+2 (int_mm)": median_ms(lambda: two_int_mm.matmul(x2), args.repeats if has_avx512_vnni() else 1),
            "exact 2+2 (int16, decoder-like)": median_ms(lambda: two16r.matmul(x2r), args.repeats),
            "exact 2+2 (fp64)": median_ms(lambda: two.matmul(x2), args.repeats),
            # ... times the weight, plus the weight residual times the first pass
            "old default (3 fp32)": median_ms(lambda: (one.matmul(x_old), one.matmul(xf)), args.repeats),
        }
        rows.append((name, times))
    columns = list(rows[0][1])
    lines = ["# Exact integer products vs fp32, per projection", "",
             f"`.venv/bin/python bench/gemm_routes.py --threads {args.threads}`: {ROWS} rows, median of "
             f"{args.repeats} (`_int_mm` without VNNI: 1 run), ms; {time.strftime('%Y-%m-%d')}, {machine()}, torch "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}.", "",
             "| projection | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for name, times in rows:
        lines.append(f"| {name} | " + " | ".join(f"{times[c]:.1f}" for c in columns) + " |")
    totals = {c: sum(t[c] for _, t in rows) for c in columns}
    lines.append("| **one layer** | " + " | ".join(f"**{totals[c]:.1f}**" for c in columns) + " |")
    lines += ["", "Per layer relative to fp32 sgemm: " + ", ".join(
        f"{c} {totals[c] / totals['fp32 sgemm']:.2f}x" for c in columns if c != "fp32 sgemm") + "."]
    write_result("gemm_routes.md", lines)


if __name__ == "__main__":
    main()
