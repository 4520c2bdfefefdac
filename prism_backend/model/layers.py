"""Row-wise building blocks: RMSNorm, rotary embedding, SwiGLU (projections live in quant.py).

Each works on one token (one row) at a time, so a token's result never depends on which other
rows are in the batch. On CPUs where the kernel library loads, RMSNorm and SwiGLU run in it
(kernels/cpu/rowwise.py: one operation order on every x86 CPU kind, where torch's vectorised
reductions and exp follow the CPU's vector width); the torch code below is their reference and
the GPU path.
"""
from __future__ import annotations

import torch

from kernels.cpu import rowwise
from kernels.cpu.prologues import Hadamard, Prologue, RmsNorm, SwiGLU

from .rotation import online_down
from .trig import rotary_cos_sin


def _library_runs(x: torch.Tensor) -> bool:
    return not x.is_cuda and x.dtype == torch.float32 and rowwise.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., H) float32, normalised over the last dimension (as Hugging Face's LlamaRMSNorm:
    weight * (x * rsqrt(mean(x^2) + eps)), the same IEEE steps, with one output buffer)."""
    if _library_runs(x):
        return rowwise.rms_norm(x, weight, eps)
    inverse_rms = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
    return torch.mul(x, inverse_rms).mul_(weight)


class RotaryTable:
    """cos and sin of every position, computed once. Looking rows up (instead of evaluating cos/sin
    over the batch's positions) keeps a token's values independent of how many tokens are packed.
    The angles are float32 products as Hugging Face's; their cos and sin come from
    trig.rotary_cos_sin (IEEE float64 steps, rounded once) rather than torch's cos, which gave one
    of two results per process on an Intel Xeon with AMX (trig.py)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # (P, head_dim/2)
        self.cos, self.sin = rotary_cos_sin(freqs, scaling)  # (P, head_dim)

    def __call__(self, positions: torch.Tensor):
        """positions: (N,) -> cos, sin: (N, 1, head_dim), broadcast over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); the rotate-half convention of Hugging Face Llama/Qwen:
    x * cos + cat(-x2, x1) * sin for x = cat(x1, x2), written half by half (x1 * cos - x2 * sin,
    x2 * cos + x1 * sin): the same IEEE operations on every element (a - b is a + (-b) exactly),
    without materialising the negated, concatenated copy (on the query heads' (N, 9, 64) that
    was ~15x the time, bench-measured). On CPUs where the kernel library loads, its one-pass
    version of these same operations (kernels/cpu/rowwise.rotary: the same bits).
    cos, sin: (N, 1, head_dim) as RotaryTable returns them."""
    if _library_runs(x):
        return rowwise.rotary(x, cos[:, 0], sin[:, 0])
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos[..., :half], out=out[..., :half]).sub_(x2 * sin[..., :half])
    torch.mul(x2, cos[..., half:], out=out[..., half:]).add_(x1 * sin[..., half:])
    return out


def swiglu(gate_up: torch.Tensor, hadamard_block: int = 0) -> torch.Tensor:
    """gate_up: (N, 2 I) with gate first -> silu(gate) * up, (N, I), in one output buffer; with
    hadamard_block (a rotated model's down_block) then times down_proj's online block-diagonal
    Hadamard (rotation.online_down), in the kernel library's same pass.

    SiLU is written as gate / (1 + exp(-gate)) rather than F.silu: F.silu's vectorised loop and its
    scalar loop (the last < 16 elements of each thread's share of the tensor) round differently in
    ~4% of values, so with F.silu an element's bits depend on where the thread split falls, i.e. on
    the thread count. torch.exp gives every element the same bits wherever it sits (checked in
    tests/test_thread_invariance.py), and negation, addition, division and the product with `up`
    are exact IEEE steps. In place on one buffer: ~0.8x the time of the out-of-place expression."""
    if _library_runs(gate_up) and hadamard_block & (hadamard_block - 1) == 0:
        return rowwise.swiglu(gate_up, hadamard_block)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.neg(gate)
    torch.div(gate, out.exp_().add_(1.0), out=out)
    out.mul_(up)
    return online_down(out, hadamard_block) if hadamard_block else out


def library_runs_prologue(prologue: Prologue) -> bool:
    """Whether the kernel library's quantisers can run this row pass (a Hadamard block that is not a
    power of two, a Paley one, is torch's: rotation.online_down)."""
    block = getattr(prologue, "hadamard_block", 0)
    return block & (block - 1) == 0


def apply_prologue(prologue: Prologue, x: torch.Tensor) -> torch.Tensor:
    """x after the row pass a projection was given to run in front of its quantiser (kernels/cpu/
    prologues.py), computed here as its own pass: for projections whose kernel has no fused form
    (fp32, the calibration's, tensor-parallel, the GPU path). The same bits as the fused form."""
    if prologue is None:
        return x
    if isinstance(prologue, RmsNorm):
        return rms_norm(x, prologue.weight, prologue.eps)
    if isinstance(prologue, Hadamard):
        return online_down(x, prologue.hadamard_block)
    return swiglu(x, prologue.hadamard_block)
