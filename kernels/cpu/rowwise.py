"""The decoder's row-wise passes on x86 CPUs (csrc/rowwise.cpp, built into the kernel library): RMSNorm,
SwiGLU (with down_proj's online Hadamard in the same pass), the Hadamard transform alone and the rotary
embedding, each with one operation order on every x86 CPU kind (AVX2 + FMA instructions, and SwiGLU's SiLU 16
lanes at a time where the CPU has AVX-512, each lane the same steps: the same bits on an AVX2-only EPYC and an
AVX-512 Xeon), every row by one thread (batch- and thread-count invariant). Their torch
references are prism_backend/model/layers.py's rms_norm, swiglu and apply_rotary and model/hadamard.transform
(tests/test_rowwise_cpu.py); prism_backend/model uses these where the library loads.
"""
from __future__ import annotations

import torch

from kernels.cpu.exact_gemm import _library, load
from kernels.cpu.features import wide_lanes


def available() -> bool:
    """Whether the passes run here (the kernel library loads: x86 with AVX2 + FMA)."""
    return load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., H) float32 -> (x * (1 / sqrt(mean(x^2) + eps))) * weight, the mean's sum in a fixed order."""
    rows = x.float().reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    weight = weight.float().contiguous()
    _library().prism_rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(), eps, out.data_ptr(),
                              torch.get_num_threads())
    return out.view(x.shape)


def swiglu(gate_up: torch.Tensor, hadamard_block: int = 0, wide: bool | None = None) -> torch.Tensor:
    """gate_up (N, 2 I) float32, gate first -> silu(gate) * up (N, I) with SiLU as gate / (1 + exp(-gate))
    (the library's exp); with hadamard_block > 0 (a power of two dividing I) then times the block-diagonal
    Hadamard, as hadamard_rows would, in the same pass. wide: 16 lanes per instruction (AVX-512; the
    default where the CPU has it) or 8 -- the same bits."""
    wide = wide_lanes(wide, "SwiGLU")
    gate_up = gate_up.float().contiguous()
    n, i = gate_up.shape[0], gate_up.shape[1] // 2
    if hadamard_block and (hadamard_block & (hadamard_block - 1) or i % hadamard_block):
        raise ValueError(f"the Hadamard block must be a power of two dividing {i}, got {hadamard_block}")
    out = torch.empty(n, i, dtype=torch.float32)
    _library().prism_swiglu(gate_up.data_ptr(), n, i, hadamard_block, out.data_ptr(), int(wide),
                            torch.get_num_threads())
    return out


def hadamard_rows(x: torch.Tensor, block: int, wide: bool | None = None) -> torch.Tensor:
    """x (M, K) float32 -> x H, H block-diagonal Sylvester Hadamard of blocks of `block` (a power of
    two dividing K), unnormalised; bit-identical to prism_backend.model.hadamard.transform (the same
    butterfly, stage by stage), ~10x faster than torch's stage-by-stage version. A new tensor.
    wide: 16 pairs per instruction (AVX-512; the default where the CPU has it) or 8 -- the same bits."""
    wide = wide_lanes(wide, "the Hadamard")
    if block & (block - 1) or x.shape[-1] % block or x.dtype != torch.float32:
        raise ValueError(f"hadamard_rows needs float32 rows and a power-of-two block dividing them, got "
                         f"{x.dtype} ({tuple(x.shape)}), block {block}")
    out = x.contiguous().clone()
    _library().prism_hadamard_rows(out.data_ptr(), out.shape[0], out.shape[1], block, int(wide),
                                   torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, D) float32, cos and sin (N, D): the rotate-half rotary embedding of each row with
    its own angles, bit-identical to prism_backend.model.layers.apply_rotary's torch operations (the
    same products, differences and sums, one pass instead of five). x may be a view whose rows lie
    apart (the queries or keys inside the qkv projection's output): read in place. A new tensor."""
    if not (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]):
        x = x.contiguous()  # heads of each row adjacent, rows anywhere apart: what the kernel reads
    n, heads, d = x.shape
    if d % 2 or cos.shape != (n, d) or sin.shape != (n, d) or x.dtype != torch.float32:
        raise ValueError(f"rotary needs float32 x (N, heads, even D) and cos, sin (N, D), got {x.dtype} "
                         f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(n, heads, d, dtype=torch.float32)
    _library().prism_rotary(x.data_ptr(), n, heads, d, x.stride(0) if n > 1 else heads * d, cos.data_ptr(),
                            sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
