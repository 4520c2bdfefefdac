"""cos and sin with the same bits in every process, on every x86 CPU, at any thread count.

torch's float32 cos was found to give one of two results per process on an Intel Xeon with AMX:
about one process in 50 built the rotary table's cos with other last bits (sin the same), whatever
the torch and MKL thread counts, MKL's code branch or torch's CPU capability
(docs/determinism-and-precision.md, "A rare divergence between builds"). So the rotary table is
computed here from IEEE float64 additions, multiplications and a round-half-even, one fixed order per
element (torch's element-wise float64 kernels do exactly these at any vector width), and rounded once
to float32: fdlibm's reduction by pi/2 in three parts and its kernel polynomials on [-pi/4, pi/4]
(Sun's __kernel_sin / __kernel_cos coefficients). Accurate to ~1e-16 before the rounding, so the
float32 result is the correctly rounded cos / sin but for the rare value within ~1e-16 of a tie.
"""
from __future__ import annotations

import torch

INV_PIO2 = 6.36619772367581382433e-01  # 2 / pi
# pi / 2 = PIO2_1 + PIO2_2 + PIO2_2T: the first two with 33 bits each, so n * PIO2_1 and n * PIO2_2 are
# exact for |n| < 2^20 (angles below ~1.6e6 rad; the rotary table's reach 8191 x 1)
PIO2_1 = 1.57079632673412561417e00
PIO2_2 = 6.07710050630396597660e-11
PIO2_2T = 2.02226624879595063154e-21
MAX_ANGLE = 1.6e6

S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
     2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
     -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)


def _horner(z: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """c0 + z (c1 + z (c2 + ...)), multiplications and additions rounded one by one."""
    acc = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc.mul_(z).add_(c)
    return acc


def cos_sin(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: angles (any shape, float32 or float64, |x| < 1.6e6) -> (cos x, sin x) as float32."""
    x = x.to(torch.float64)
    largest = x.abs().max().item() if x.numel() else 0.0
    if largest >= MAX_ANGLE:
        raise ValueError(f"cos_sin reduces angles below {MAX_ANGLE:g} rad exactly, got {largest:g}")
    n = torch.mul(x, INV_PIO2).round_()  # the nearest multiple of pi / 2 (half to even)
    r = torch.sub(x, n * PIO2_1).sub_(n * PIO2_2).sub_(n * PIO2_2T)  # x - n pi / 2, |r| <= pi / 4
    z = r * r
    sin_r = r + (z * r) * _horner(z, S)  # r + r^3 (S1 + z (S2 + ...))
    cos_r = 1.0 - (0.5 * z - z * (z * _horner(z, C)))  # 1 - z / 2 + z^2 (C1 + z (C2 + ...))
    quadrant = n.to(torch.int64).remainder_(4)  # cos: cos, -sin, -cos, sin; sin: sin, cos, -sin, -cos
    cos = torch.where(quadrant % 2 == 0, cos_r, sin_r)
    sin = torch.where(quadrant % 2 == 0, sin_r, cos_r)
    cos = torch.where((quadrant == 1) | (quadrant == 2), -cos, cos)
    sin = torch.where(quadrant >= 2, -sin, sin)
    return cos.float(), sin.float()


def rotary_cos_sin(freqs: torch.Tensor, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """freqs: rotary angles (..., head_dim / 2) -> cos and sin of cat(freqs, freqs) times `scaling`,
    (..., head_dim) float32 each: the rotate-half convention's tables (Prism's RotaryTable, and the
    Hugging Face reference's rotary modules, prism_launcher/reference.py)."""
    cos, sin = cos_sin(freqs)
    return tuple(torch.cat((t, t), dim=-1) * scaling for t in (cos, sin))
