"""The calibration's float64 steps on x86 CPUs (csrc/calibration.cpp, built into the kernel library):
GPTQ's rounding of a block of columns, the Hadamard transform of the offline rotation and the Hessians'
accumulation, the same IEEE operations in the same order as their torch references
(prism_backend/model/gptq.py's _round_block and Hessian, prism_backend/model/hadamard.transform), so the
same bits -- without a torch call and its temporaries per column (GPTQ), per factor row (the Hadamard) or
per pass over H (the Hessians), which made them most of a cold start's calibration.
tests/test_calibration_kernels.py compares each with its reference."""
from __future__ import annotations

import torch

from kernels.cpu.exact_gemm import _library, load


def available() -> bool:
    """Whether these run here (the kernel library loads: x86 with AVX2 + FMA)."""
    return load() is not None


def gptq_block(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor, bound: int,
               q: torch.Tensor) -> torch.Tensor:
    """GPTQ's rounding of one block of columns. w (rows, width) float64 the block's weights (a view
    into the whole matrix; read only), s (rows,) float64 scales, u (width, width) float64 the block of
    H^-1's upper Cholesky factor (a view), q (rows, width) float64 where the integers go (a view) ->
    err (rows, width) float64, each column's rounding error divided by its diagonal entry of u."""
    rows, width = w.shape
    if any(t.dtype != torch.float64 for t in (w, s, u, q)) or q.stride(-1) != 1:
        raise ValueError("gptq_block takes float64 tensors, q with unit column stride (it is written in place)")
    if s.shape != (rows,) or u.shape != (width, width) or q.shape != (rows, width):
        raise ValueError(f"gptq_block: w {tuple(w.shape)}, s {tuple(s.shape)}, u {tuple(u.shape)}, q {tuple(q.shape)}")
    # rows with unit column stride (LAPACK's factor comes column-major): copies, the same numbers
    w, u, s = (t if t.stride(-1) == 1 else t.contiguous() for t in (w, u, s))
    err = torch.empty(rows, width, dtype=torch.float64)
    _library().prism_gptq_block(w.data_ptr(), rows, width, w.stride(0), s.data_ptr(), u.data_ptr(), u.stride(0),
                                float(bound), q.data_ptr(), q.stride(0), err.data_ptr(), width)
    return err


def hadamard_f64(x: torch.Tensor, order: int, factors: tuple[int, ...], signs: list[torch.Tensor]) -> torch.Tensor:
    """x (..., n) float64, n a multiple of `order` -> a new tensor, each run of `order` coordinates
    times H = signs[0] x signs[1] x ... (Kronecker; factors their orders, the first applied first, as
    hadamard.transform does)."""
    if x.dtype != torch.float64 or x.shape[-1] % order or len(factors) != len(signs):
        raise ValueError(f"hadamard_f64 needs float64 rows whose width is a multiple of {order}, got {x.dtype} "
                         f"{tuple(x.shape)}")
    out = x.clone(memory_format=torch.contiguous_format)  # one copy, contiguous, even from a strided view
    if not factors:
        return out
    sizes = torch.tensor(factors, dtype=torch.int32)
    table = torch.cat([h.to(torch.float64).reshape(-1) for h in signs])  # each factor's (f, f) of +-1
    _library().prism_hadamard_f64(out.data_ptr(), out.numel() // order, order, sizes.data_ptr(), len(factors),
                                  table.data_ptr())
    return out


def hessian_add(q: torch.Tensor, ends: list[int], scales: list[float], h: torch.Tensor) -> None:
    """h (W, W) float64, contiguous: h += sum over groups g of (Q_g^T Q_g) * scales[g], group by group in
    order, on and above the diagonal (and the rest of each 4 x 8 tile that holds such entries; what is
    below is not read). q (R, W) float64 integers with |q| <= 2^20, its rows in groups of at most 2^13:
    group g is rows [ends[g - 1], ends[g]). Each group's sums are exact, so the one rounding per group
    and entry is the torch reference's (model/gptq.Hessian)."""
    rows, width = q.shape
    if q.dtype != torch.float64 or h.dtype != torch.float64 or h.shape != (width, width):
        raise ValueError(f"hessian_add: q {q.dtype} {tuple(q.shape)}, h {h.dtype} {tuple(h.shape)}")
    if not h.is_contiguous() or len(ends) != len(scales) or (ends and ends[-1] != rows):
        raise ValueError("hessian_add: h must be contiguous and the groups must end at q's last row")
    q = q.contiguous()
    ends_t = torch.tensor(ends, dtype=torch.int32)
    scales_t = torch.tensor(scales, dtype=torch.float64)
    _library().prism_hessian_add(q.data_ptr(), rows, width, ends_t.data_ptr(), scales_t.data_ptr(), len(ends),
                                 h.data_ptr(), torch.get_num_threads())
