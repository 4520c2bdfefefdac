"""Row passes a quantiser of the kernel library can run in its own pass, in front of a projection.

A projection whose kernel quantises its input row by row (exact_gemm.PackedWeight, PackedWeight8) can
take its input as the output of one of these passes, computed row by row into a buffer of the thread's
and quantised from there (csrc/rowwise.cpp, prism_*_quantize_*): the float32 rows are never written
out and read back. The same operations as the pass followed by the quantiser (rowwise.rms_norm,
rowwise.swiglu), so the same integers and scales (tests/test_rowwise_cpu.py).

Rotary is the one pass a kernel runs after its product instead: the AVX-512 VNNI tiles (PackedWeight
with vnni, PackedWeight8 without glu) apply it to each head of 64 output columns while the tile's
rows are still in L1 (csrc/exact_gemm.cpp rotate_head), rowwise.rotary's operations, so its bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RmsNorm:
    """x (M, H) -> rowwise.rms_norm(x, weight, eps): weight (H,) float32."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True, eq=False)
class SwiGLU:
    """gate_up (M, 2 I), gate first -> rowwise.swiglu(gate_up, hadamard_block): (M, I)."""

    hadamard_block: int = 0


@dataclass(frozen=True, eq=False)
class Hadamard:
    """x (M, K) -> rowwise.hadamard_rows(x, hadamard_block): down_proj's online rotation alone, where
    gate_up's kernel already ended in SwiGLU (PackedWeight8(glu=True))."""

    hadamard_block: int


Prologue = RmsNorm | SwiGLU | Hadamard | None  # what a quantiser may be given

ROTARY_HEAD = 64  # the head width of the rotary epilogue (ROTARY_HEAD in csrc/exact_gemm.cpp: one VNNI tile)


@dataclass(frozen=True, eq=False)
class Rotary:
    """The output's first `columns` columns (a multiple of ROTARY_HEAD: a qkv projection's query and
    key heads) -> rowwise.rotary of each head, row r with cos[r], sin[r]: (M, ROTARY_HEAD) float32."""

    cos: torch.Tensor
    sin: torch.Tensor
    columns: int
