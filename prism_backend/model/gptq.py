"""GPTQ: round a weight matrix to 8-bit integers one input column at a time, each column's rounding
error compensated by the columns not yet rounded (Frantar et al., 2022; the algorithm of the
reference implementation, IST-DASLab/gptq `gptq.py`, in float64).

Round-to-nearest minimises each weight's own error; what matters is the error of the layer's
output on the activations it will see, ||X Wᵀ - X Qᵀ||. With the inputs' second moments
H = Xᵀ X (from calibration prompts), GPTQ quantises column j, then moves its error onto the later
columns along H⁻¹'s Cholesky factor, so that the next roundings absorb it.

Reproducible: the Hessian has the same bits on every machine (Hessian.add; its inputs come from a
forward whose projections are exact, engine/calibration.py), and every step after it is float64
arithmetic in a fixed order on one thread per matrix (quantize_layer_by_layer). Only the Cholesky
factorisations and the blocked update go through LAPACK/BLAS, whose last bits may differ between
CPU vendors (~1e-16 relative); an integer then changes only where a weight lies within ~1e-12 of a
rounding tie: for SmolLM2's 1.3e8 weights, about a 3-in-10,000 chance that any does.

Bias correction (quantize_layer_by_layer, from the same forward; measure_corrections measures it
again, or any integers' error, with a forward of its own): GPTQ minimises the spread of a projection's output error, not
its mean, and 8-bit activations add their own rounding. What remains systematic moves near-tie
decisions one way: on the eval's binary contract set the 8-bit plan lost 1.1 points of accuracy with
as many changed answers as bf16. So each projection's mean output error over the calibration rows
(fp32 output - 8-bit output, per output channel) is measured and served as its bias, which makes
that mean zero (the bias correction of Nagel et al. 2019, "Data-Free Quantization", measured on
calibration data instead of derived from batch-norm statistics). Measured exactly: each error is
rounded to a multiple of 2^-32 and the multiples are summed as int64, in any order the same.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels.cpu import calibration as calibration_kernels

from ..config import ComputeSettings
from .fixed_point import FLOAT64_INTEGER_BITS, to_fixed
from .layers import apply_prologue
from .quant import make_linear

BLOCK = 128  # columns per lazy-update block (the reference implementation's)
DAMP = 0.01  # dampening, a fraction of the mean diagonal of H


HESSIAN_BITS = 20  # |q| <= 2^20 per input: products below 2^40, so 2^13 rows sum exactly in float64
HESSIAN_ROWS = 1 << (FLOAT64_INTEGER_BITS - 2 * HESSIAN_BITS)  # rows per exact product
HESSIAN_BLOCK = 192  # columns per block of H: only the blocks on and above the diagonal are multiplied


class Hessian:
    """Accumulates H = sum of xᵀ x over the rows a projection sees, in float64, with the same bits
    on every machine (a float64 Xᵀ X through BLAS sums in a CPU-dependent order)."""

    def __init__(self, width: int):
        self.upper = torch.zeros(width, width, dtype=torch.float64)  # H on and above the diagonal (below: unused)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (N, width) float32 inputs of the projection. Each row becomes a 20-bit integer vector
        times a power of two (fixed_point.to_fixed); the rows sharing a power are multiplied together
        exactly (float64 integers below 2^53: no order can change the sum), and those products are
        added into H one power at a time, increasing: one fixed order of float64 roundings. H is
        symmetric, so only its entries on and above the diagonal are computed; `h` mirrors them. In
        the kernel library where it loads (kernels/cpu/calibration.py: the same sums and roundings,
        H read and written once a call), else torch's products of H's blocks."""
        q, e = to_fixed(x, HESSIAN_BITS)  # (N, width) integers, (N, 1)
        e = e[:, 0]
        powers, counts = torch.unique(e, return_counts=True)  # ascending
        q = q[torch.argsort(e, stable=True)]  # one copy: the rows grouped by power, each group in row order
        groups = [(math.ldexp(1.0, 2 * power), chunk)
                  for power, rows in zip(powers.tolist(), q.split(counts.tolist()))
                  for chunk in rows.split(HESSIAN_ROWS)]
        if groups and calibration_kernels.available():
            ends = torch.tensor([len(chunk) for _, chunk in groups]).cumsum(0).tolist()
            calibration_kernels.hessian_add(q, ends, [scale for scale, _ in groups], self.upper)
        else:
            width = q.shape[1]
            for scale, chunk in groups:
                for start in range(0, width, HESSIAN_BLOCK):
                    end = min(start + HESSIAN_BLOCK, width)
                    self.upper[start:end, start:].add_((chunk[:, start:end].T @ chunk[:, start:]).mul_(scale))
        self.rows += x.shape[0]

    @property
    def h(self) -> torch.Tensor:
        """H (width, width) float64. Its entries below the diagonal are taken from above it (a
        selection, no arithmetic): each entry of a product is an exact integer, so H[i, j] and H[j, i]
        are the same number."""
        width = self.upper.shape[0]
        above = torch.ones(width, width, dtype=torch.bool).triu_()
        return torch.where(above, self.upper, self.upper.T)


def gptq(weight: torch.Tensor, h: torch.Tensor, bound: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float32, h (in, in) float64 -> (integers (out, in) float32 with
    |q| <= bound, per-output-channel scales (out,) float32) such that q * scale ~ weight on the
    inputs h describes. Scales are symmetric min-max (amax / bound), as round-to-nearest's."""
    w = weight.to(torch.float64).clone()
    out_dim, in_dim = w.shape
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / bound, torch.ones_like(amax)).float()  # (out,)
    s = scale.to(torch.float64)[:, None]  # the float32 scale the engine dequantises with

    h = h.clone()
    dead = torch.diag(h) == 0  # inputs never seen: their weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMP * torch.mean(torch.diag(h)) * torch.eye(in_dim, dtype=torch.float64)
    # the upper Cholesky factor of H^-1: row j holds how column j's error spreads to the later ones
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    q = torch.zeros_like(w)
    round_block = calibration_kernels.gptq_block if calibration_kernels.available() else _round_block
    for start in range(0, in_dim, BLOCK):
        end = min(start + BLOCK, in_dim)
        err_block = round_block(w[:, start:end], s[:, 0], u[start:end, start:end], bound, q[:, start:end])
        w[:, end:] -= err_block @ u[start:end, end:]
    return q.float(), scale


def _round_block(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor, bound: int, q: torch.Tensor) -> torch.Tensor:
    """GPTQ's rounding of one block of columns, column by column: w (out, B) the block's weights (not
    written), s (out,) the scales, u (B, B) the block of U, q (out, B) where the integers go -> the
    block's errors (out, B), each divided by its diagonal entry of U. The reference of the kernel
    library's gptq_block (kernels/cpu/calibration.py: the same operations per element, ~10x faster)."""
    w = w.clone()
    err_block = torch.zeros_like(w)
    for j in range(w.shape[1]):
        column = w[:, j]
        q_col = torch.clamp(torch.round(column / s), -bound, bound)
        q[:, j] = q_col
        err = (column - q_col * s) / u[j, j]
        w[:, j:] -= err[:, None] * u[j, j:][None, :]
        err_block[:, j] = err
    return err_block


class _Recorder:
    """Wraps an fp32 projection; accumulates the Hessian of the inputs it sees and holds each call's
    input and fp32 output (its rows for the bias correction, until the layer is quantised)."""

    def __init__(self, inner):
        self.inner, self.hessian, self.seen = inner, Hessian(inner.weight.shape[1]), []

    def __call__(self, x, residual=None, prologue=None):
        x = apply_prologue(prologue, x)
        self.hessian.add(x)
        y = self.inner(x)  # (N, out) float32
        self.seen.append((x, y))
        return y if residual is None else y + residual


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def quantize_layer_by_layer(model, forests, workers: int = 1) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """GPTQ's 8-bit integers, scales and bias corrections of every projection, per layer
    {name: (q (out, in) float32, scale (out,), correction (out,))}, from one pass of an fp32
    ForestTransformer built with every_row=True over `forests`, layer by layer
    (ForestTransformer.layer_by_layer): once every forest has gone through layer i, its projections'
    Hessians are complete (each input's rows added forest by forest, as a loop of forwards adds
    them), so its matrices are quantised and their corrections measured on the inputs and fp32
    outputs the projections saw, held for that layer only (~170 MB for SmolLM2's ~5,100 rows). Down's
    inputs are after the online rotation. The forward runs on the caller's threads (its products are
    exact integer sums, its other steps thread-invariant kernels); GPTQ's float64 steps on one thread
    per matrix, `workers` matrices at once (torch's element-wise and LAPACK calls release the GIL):
    a matrix's steps and their order do not depend on the thread that runs them or on what runs
    beside it, so neither do its integers."""
    from ..reproducibility import torch_threads

    def one(job):
        torch.set_num_threads(1)  # this worker's OpenMP and MKL settings (thread-local) at one
        return gptq(*job)

    layers, out = model.layer_by_layer(forests), []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for p in model.proj:
            recorders = {name: _Recorder(getattr(p, name)) for name in PROJECTIONS}
            for name, recorder in recorders.items():
                setattr(p, name, recorder)
            next(layers)  # every forest through this layer
            with torch_threads(1):
                integers = list(pool.map(one, [(r.inner.weight, r.hessian.h) for r in recorders.values()]))
            quantized = {}
            for (name, recorder), ints in zip(recorders.items(), integers):
                errors = _ErrorRecorder(recorder.inner, ints)
                with torch.inference_mode():  # the rows are the forward's inference tensors
                    for x, y in recorder.seen:
                        errors.add(x, y)
                quantized[name] = (*ints, errors.mean())
                setattr(p, name, recorder.inner)
            out.append(quantized)
    return out


CORRECTION_BITS = 32  # output errors summed as int64 multiples of 2^-32: exact for |sum| < 2^31


class _ErrorRecorder:
    """Wraps an fp32 projection and its 8-bit form; sums, per output channel and exactly, the error
    the 8-bit form makes on the rows the fp32 model feeds it. The fp32 output goes on."""

    def __init__(self, inner, integers: tuple[torch.Tensor, torch.Tensor]):
        self.inner = inner
        self.quantized = make_linear(None, None, ComputeSettings(precision="int8"), integers)  # as served
        self.sum = torch.zeros(integers[0].shape[0], dtype=torch.int64)
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x (N, in) the projection's input, y (N, out) its fp32 output on it."""
        error = y.double() - self.quantized(x).double()  # element-wise: the same bits on every CPU
        self.sum += torch.round(error * 2.0**CORRECTION_BITS).to(torch.int64).sum(dim=0)
        self.rows += x.shape[0]

    def __call__(self, x, residual=None, prologue=None):
        x = apply_prologue(prologue, x)
        y = self.inner(x)  # (N, out) float32
        self.add(x, y)
        return y if residual is None else y.add_(residual)

    def mean(self) -> torch.Tensor:
        return (self.sum.double() / (self.rows * 2.0**CORRECTION_BITS)).float()  # (out,)


def measure_corrections(model, forests, integers: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Run the fp32 ForestTransformer (every_row=True) over `forests`; per layer and projection, the
    mean over the rows of (fp32 output - output of its 8-bit `integers`), (out,) float32: the bias that
    makes the 8-bit projection's mean error zero on those rows. Each projection is measured on the
    fp32 model's inputs, so a correction does not depend on which others the plan serves in 8 bits."""
    for p, layer in zip(model.proj, integers):
        for name in PROJECTIONS:
            setattr(p, name, _ErrorRecorder(getattr(p, name), layer[name]))
    for forest in forests:
        model.answer_hidden(forest)
    corrections = []
    for p in model.proj:
        corrections.append({name: getattr(p, name).mean() for name in PROJECTIONS})
        for name in PROJECTIONS:
            setattr(p, name, getattr(p, name).inner)
    return corrections
