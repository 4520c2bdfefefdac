"""Both kernels at realistic sizes on a CUDA device: correctness against the references and speed
against torch (int8 `torch._int_mm` + torch dequantisation; SDPA per segment, as the CPU path does).

    python -m kernels.triton.gpu_check [--hidden 5120 --heads 40 --kv-heads 8 --trunk 4096 --branches 3]

Prints one markdown table; exits 2 when no CUDA device is present (nothing is measured then).
`--device cpu` runs the same checks through Triton's interpreter (TRITON_INTERPRET=1) at small
sizes: how the tests keep this script working without a GPU; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kernels.triton.exact_gemm import int8_gemm, int8_gemm_reference
from kernels.triton.tree_attention import build_layout, tree_attention, tree_attention_reference


def _time_ms(fn, device: str, repeats: int = 20) -> float:
    """Median of `repeats` runs after one warm-up (compilation)."""
    fn()
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check_gemm(m: int, k: int, n: int, passes: int, device: str, rows: list, residual: bool = False) -> None:
    """residual: also the weight residual product (Prism's default int8, weight_passes=2)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(-127, 128, (passes * m, k), dtype=torch.int8, device=device, generator=gen)
    w = torch.randint(-127, 128, (k, n), dtype=torch.int8, device=device, generator=gen)
    xs = torch.rand(passes * m, 1, device=device, generator=gen) / 100
    ws = torch.rand(n, device=device, generator=gen) / 100
    extra = {}
    if residual:
        extra = {"w_res": torch.randint(-127, 128, (k, n), dtype=torch.int8, device=device, generator=gen),
                 "w_res_scale": torch.rand(n, device=device, generator=gen) / 10000}
    # int64 matmul exists on CPU only; 64 rows of the int32 output against it
    acc = int8_gemm(x[:m], w)[:64].cpu().long()
    exact = torch.equal(acc, x[: min(m, 64)].cpu().long() @ w.cpu().long())
    out = int8_gemm(x, w, xs, ws, passes=passes, **extra)
    ref = int8_gemm_reference(x, w, xs, ws, passes=passes, **extra)
    kernel_ms = _time_ms(lambda: int8_gemm(x, w, xs, ws, passes=passes, **extra), device)
    torch_ms = _time_ms(lambda: int8_gemm_reference(x, w, xs, ws, passes=passes, **extra), device)
    tops = 2 * (passes + residual) * m * k * n / kernel_ms / 1e9
    rows.append((f"int8 GEMM {m}x{k}x{n}, {passes} pass(es){' + weight residual' if residual else ''}",
                 f"int32 exact: {exact}; dequant bit-equal: {torch.equal(out, ref)}, "
                 f"max diff {(out - ref).abs().max().item():.2e}",
                 f"{kernel_ms:.3f}", f"{torch_ms:.3f}", f"{torch_ms / kernel_ms:.2f}x", f"{tops:.0f} TOPS"))


def check_attention(heads: int, kv_heads: int, head_dim: int, root: int, trunk: int, branches: int,
                    branch_len: int, device: str, rows: list) -> None:
    segments = [(0, root, -1), (root, trunk, 0)]
    for b in range(branches):
        segments.append((root + trunk + b * branch_len, branch_len, 1))
    n = root + trunk + branches * branch_len
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(n, heads, head_dim, device=device, generator=gen)
    k = torch.randn(n, kv_heads, head_dim, device=device, generator=gen)
    v = torch.randn(n, kv_heads, head_dim, device=device, generator=gen)
    layout = build_layout(segments).to(device)
    out = tree_attention(q, k, v, layout)
    ref = tree_attention_reference(q, k, v, layout)

    prefix = {0: 0, 1: root}  # keys before each segment's own rows: root none, trunk the root
    def sdpa_per_segment():  # the torch path's approach: each segment with its gathered ancestry
        for i, (start, length, _) in enumerate(segments):
            ancestors = torch.arange(prefix.get(i, root + trunk), device=device)
            key_rows = torch.cat([ancestors, torch.arange(start, start + length, device=device)])
            mask = (torch.arange(len(key_rows), device=device)[None, :]
                    <= (len(ancestors) + torch.arange(length, device=device))[:, None])
            F.scaled_dot_product_attention(q[start : start + length].transpose(0, 1)[None],
                                           k[key_rows].transpose(0, 1)[None], v[key_rows].transpose(0, 1)[None],
                                           attn_mask=mask, enable_gqa=True)

    kernel_ms = _time_ms(lambda: tree_attention(q, k, v, layout), device)
    torch_ms = _time_ms(sdpa_per_segment, device)
    rows.append((f"tree attention {heads}/{kv_heads} heads x {head_dim}, root {root} + trunk {trunk} + "
                 f"{branches} x {branch_len}",
                 f"max diff vs reference {(out - ref).abs().max().item():.2e}",
                 f"{kernel_ms:.3f}", f"{torch_ms:.3f}", f"{torch_ms / kernel_ms:.2f}x", ""))


GEMM_TILES = [(32, 64, 64, 4, None), (64, 128, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3),
              (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4), (256, 128, 64, 8, 3)]
ATTENTION_TILES = [(16, 32, 4), (16, 64, 4), (32, 32, 4), (32, 64, 4), (64, 32, 4), (64, 64, 4), (64, 64, 8),
                   (128, 32, 8), (128, 64, 8)]


def tune(hidden: int, heads: int, kv_heads: int, trunk: int, branches: int, device: str) -> None:
    """Times the kernels' tile shapes (block_m, block_n, block_k / warps / stages) at one model's
    sizes and prints one table: how their defaults were chosen."""
    head_dim, gen = hidden // heads, torch.Generator(device=device).manual_seed(2)
    n = hidden + 2 * kv_heads * head_dim
    print(f"| kernel at hidden {hidden}, {heads}/{kv_heads} heads, trunk {trunk} | tile | ms | correct |\n|---|---|---|---|")
    for m in (64 + trunk + branches * 32, 24):
        x = torch.randint(-127, 128, (2 * m, hidden), dtype=torch.int8, device=device, generator=gen)
        w, r = (torch.randint(-127, 128, (hidden, n), dtype=torch.int8, device=device, generator=gen) for _ in "wr")
        xs, ws, rs = torch.rand(2 * m, device=device, generator=gen), torch.rand(n, device=device, generator=gen), \
            torch.rand(n, device=device, generator=gen) / 1e4
        ref = int8_gemm_reference(x, w, xs, ws, None, 2, r, rs)
        for bm, bn, bk, warps, stages in GEMM_TILES:
            tile = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                same = torch.equal(int8_gemm(x, w, xs, ws, None, 2, r, rs, **tile), ref)
                ms = _time_ms(lambda: int8_gemm(x, w, xs, ws, None, 2, r, rs, **tile), device)
            except Exception as e:  # noqa: BLE001 -- a tile the compiler refuses is a row of the table
                print(f"| int8 GEMM {m} rows, 2 passes + residual | {tile} | - | {type(e).__name__} |")
                continue
            print(f"| int8 GEMM {m} rows, 2 passes + residual | {bm}x{bn}x{bk} w{warps} s{stages} | {ms:.3f} | {same} |")
    segments = [(0, 64, -1), (64, trunk, 0)] + [(64 + trunk + b * 32, 32, 1) for b in range(branches)]
    rows = 64 + trunk + branches * 32
    q = torch.randn(rows, heads, head_dim, device=device, generator=gen)
    k, v = (torch.randn(rows, kv_heads, head_dim, device=device, generator=gen) for _ in "kv")
    ref = tree_attention_reference(q, k, v, build_layout(segments).to(device))
    for bm, bn, warps in ATTENTION_TILES:
        layout = build_layout(segments, block_m=bm).to(device)
        try:
            diff = (tree_attention(q, k, v, layout, block_n=bn, num_warps=warps) - ref).abs().max().item()
            ms = _time_ms(lambda: tree_attention(q, k, v, layout, block_n=bn, num_warps=warps), device)
        except Exception as e:  # noqa: BLE001
            print(f"| tree attention | {bm}x{bn} w{warps} | - | {type(e).__name__}: {str(e)[:80]} |")
            continue
        print(f"| tree attention | {bm}x{bn} w{warps} | {ms:.3f} | max diff {diff:.1e} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--trunk", type=int, default=4096)
    parser.add_argument("--branches", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tune", action="store_true", help="time the kernels' tile shapes instead")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the GPU check has not run (the kernels are tested on CPU under TRITON_INTERPRET=1)")
        return 2
    if args.tune:
        tune(args.hidden, args.heads, args.kv_heads, args.trunk, args.branches, args.device)
        return 0
    head_dim = args.hidden // args.heads
    qkv_out = args.hidden + 2 * args.kv_heads * head_dim
    rows: list = []
    tokens = 64 + args.trunk + args.branches * 32
    for m, n, passes, residual in ((tokens, qkv_out, 1, False), (tokens, qkv_out, 2, False),
                                   (tokens, qkv_out, 2, True), (24, qkv_out, 2, True)):
        check_gemm(m, args.hidden, n, passes, args.device, rows, residual)
    check_attention(args.heads, args.kv_heads, head_dim, 64, args.trunk, args.branches, 32, args.device, rows)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}, torch {torch.__version__}\n")
    print("| check | correctness | kernel ms | torch ms | speedup | throughput |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
