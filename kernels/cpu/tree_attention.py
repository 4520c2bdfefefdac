"""Tree attention over a packed forest on x86 CPUs (csrc/tree_attention.cpp, built into the exact GEMMs'
library): every segment's rows attend to their ancestors' rows and, causally, their own, in float32
or in integers (its products exact int32 sums, vpdpwssd / vpmaddwd: csrc/tree_attention_int.inc),
with one operation order whatever the CPU kind (AVX2 or AVX-512), the thread count or the batch, so
the same request gives the same bits on every x86-64 machine with AVX2 and FMA. Its torch reference
is softmax(q kᵀ / 8 + mask) v in float64 (tests/test_tree_attention_cpu.py); prism_backend's
attention.py calls it for CPU tensors.
"""
from __future__ import annotations

import torch

from kernels.cpu.exact_gemm import _library, load
from kernels.cpu.features import has_avx512_vnni, wide_lanes

HEAD_DIM = 64  # the kernel's head dimension (1 / sqrt(64) is a power of two: q's scaling is exact)


def available(head_dim: int) -> bool:
    """Whether the kernel runs here for this head dimension (the library loads: x86 with AVX2 + FMA)."""
    return head_dim == HEAD_DIM and load() is not None


def segment_table(segments: list[tuple[int, int, torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(first query row, query rows, key rows (L,), keys before its own rows)] -> (the key rows of every
    segment concatenated, int32; (S, 5) int32 rows (q_start, q_len, key_offset, keys, prefix)). Built
    once per forward and used by every layer."""
    rows, table, offset = [], [], 0
    for q_start, q_len, key_rows, prefix in segments:
        rows.append(key_rows.to(torch.int32))
        table.append((q_start, q_len, offset, key_rows.numel(), prefix))
        offset += key_rows.numel()
    key_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int32)
    return key_rows.contiguous(), torch.tensor(table, dtype=torch.int32).reshape(-1, 5).contiguous()


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
                   table: torch.Tensor, wide: bool | None = None, integer: bool = False) -> torch.Tensor:
    """q: (n, Hq, 64) float32, its rows anywhere apart (the queries inside the qkv projection's output
    are read in place); k, v: (key rows, Hkv, 64) float32, their rows anywhere apart too (the keys
    and values side by side in the qkv projection's second output); key_rows, table: segment_table's ->
    (n, Hq, 64) float32; rows of q that no segment covers stay uninitialised. wide: the AVX-512
    instance (default: where the CPU has it, with VNNI for the integer form) or the AVX2 one -- the same
    bits (tests compare them). integer: q and k as 14-bit, v as 12-bit integers per row and head and the
    weights as 15-bit ones, every product summed exactly in int32 (csrc/tree_attention_int.inc),
    instead of float32."""
    if integer and wide is None:
        wide = has_avx512_vnni()
    wide = wide_lanes(wide, "tree attention")
    if integer and wide and not has_avx512_vnni():
        raise RuntimeError("the 16-lane instance of integer tree attention needs a CPU with AVX-512 VNNI")
    if q.shape[-1] != HEAD_DIM or k.shape[-1] != HEAD_DIM or q.shape[1] % k.shape[1]:
        raise ValueError(f"tree attention takes heads of {HEAD_DIM} and query heads a multiple of the key heads, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    q, k, v = (_rows_of_heads(t.float()) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=torch.float32)
    _library().prism_tree_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), key_rows.data_ptr(), table.data_ptr(),
                                    table.shape[0], q.shape[1], k.shape[1], k.shape[0], out.data_ptr(),
                                    int(wide), torch.get_num_threads(), int(integer),
                                    *(_row_stride(t) for t in (q, k, v)))
    return out


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x (rows, heads, 64) as the kernel reads it: each row's heads adjacent, rows anywhere apart
    (a copy only where x is not already so)."""
    if x.stride(2) == 1 and x.stride(1) == HEAD_DIM and x.stride(0) >= x.shape[1] * HEAD_DIM:
        return x
    return x.contiguous()


def _row_stride(x: torch.Tensor) -> int:
    """Floats from one row of _rows_of_heads' x to the next (a single row's stride can be anything)."""
    return x.stride(0) if x.shape[0] > 1 else x.shape[1] * HEAD_DIM
