"""Hadamard matrices and their transform, computed the same way on every machine.

A Hadamard matrix H of order n has entries +-1 and H Hᵀ = n I, so H / sqrt(n) is orthogonal: it
rotates a vector without changing its length, and spreads a few large coordinates over all of
them -- what lets per-token / per-channel 8-bit quantisation keep its precision (model/rotation.py).

Orders: Sylvester's 2^k, Paley's q + 1 for a prime q = 3 (mod 4) (12, 20, 24, 44, ...), and
Kronecker products of those: 576 = 12 x 12 x 4 (SmolLM2's hidden size), 1536 = 12 x 128,
896 = 224 x 4, 4864 = 152 x 32. `factors(n)` finds such a product or says there is none.

The transform x -> x H (rows of x) is written as sums and differences along one factor at a time,
each a correctly rounded IEEE addition in a fixed order. No matrix product runs, so the result does
not depend on the BLAS, the thread count, the vector width or the batch: the same bits on any CPU
(and the float64 version used offline is as reproducible as the float32 one used online).
"""
from __future__ import annotations

import functools
import math

import torch


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


@functools.lru_cache(maxsize=None)
def paley(order: int) -> torch.Tensor:
    """Paley's construction I: for a prime q = 3 (mod 4), the Hadamard matrix of order q + 1,
    H = I + [[0, 1ᵀ], [-1, J]], J the Jacobsthal matrix J[i, j] = chi(j - i) (chi: the quadratic
    character mod q). (order, order) float64, checked H Hᵀ = order * I."""
    q = order - 1
    if not (_is_prime(q) and q % 4 == 3):
        raise ValueError(f"Paley's construction gives orders q + 1 for primes q = 3 (mod 4), not {order}")
    squares = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if a in squares else -1 for a in range(1, q)]
    h = torch.eye(order, dtype=torch.float64)
    h[0, 1:] = 1
    h[1:, 0] = -1
    for i in range(q):
        for j in range(q):
            h[1 + i, 1 + j] += chi[(j - i) % q]
    assert torch.equal(h @ h.T, order * torch.eye(order, dtype=torch.float64)), order
    return h


def _paley_orders(n: int) -> list[int]:
    """Paley orders > 4 dividing n, smallest first (4 and 2 come from Sylvester's construction): a
    factor of order m costs m additions per coordinate, a factor 2 one."""
    return [m for m in range(12, n + 1, 4)
            if n % m == 0 and m & (m - 1) and _is_prime(m - 1) and (m - 1) % 4 == 3]


@functools.lru_cache(maxsize=None)
def factors(n: int) -> tuple[int, ...] | None:
    """Orders whose Kronecker product is a Hadamard matrix of order n: small Paley orders first, then
    2s (Sylvester: H_2^k = H_2 x ... x H_2); None when no such product exists (then no Hadamard
    matrix of order n is known to this module: n = 1, 2 or a multiple of 4 is necessary)."""
    if n == 1:
        return ()
    if n & (n - 1) == 0:
        return (2,) * (n.bit_length() - 1)
    for m in _paley_orders(n):
        rest = factors(n // m)
        if rest is not None:
            return (m, *rest)
    return None


def factor_matrix(order: int) -> torch.Tensor:
    """(order, order) float64 of +-1: what `transform` multiplies by along a factor of that order
    (Sylvester's [[1, 1], [1, -1]] for 2, Paley's for the others)."""
    return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) if order == 2 else paley(order)


def is_supported(n: int) -> bool:
    return factors(n) is not None


def matrix(n: int) -> torch.Tensor:
    """The Hadamard matrix (n, n) float64 that `transform` multiplies by (tests, small orders)."""
    return transform(torch.eye(n, dtype=torch.float64))


# Rows per pass of `transform`, as elements: a chunk of rows goes through every factor while it is
# still in the CPU's cache (rows are independent, so chunking changes no bit; 3x faster on the
# (49152, 576) embedding the rotation transforms at load).
CHUNK_ELEMENTS = 1 << 16


def transform(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """x (..., n) -> x H, H the Hadamard matrix of order n from factors(n), unnormalised (|H x| =
    sqrt(n) |x|), same dtype. With `block`, H is block-diagonal: each run of `block` coordinates is
    transformed on its own (n a multiple of block)."""
    n = x.shape[-1]
    order = block or n
    fs = factors(order)
    if fs is None or n % order:
        raise ValueError(f"no Hadamard transform of order {order} known for width {n}")
    rows = x.reshape(-1, n)
    step = max(1, CHUNK_ELEMENTS // n)
    if rows.shape[0] <= step:
        return _transform_rows(rows, order, fs).reshape(x.shape)
    return torch.cat([_transform_rows(chunk, order, fs) for chunk in rows.split(step)]).reshape(x.shape)


def _transform_rows(rows: torch.Tensor, order: int, fs: tuple[int, ...]) -> torch.Tensor:
    """rows (R, n) -> rows H, one factor of H at a time."""
    y = rows.reshape(rows.shape[0], -1, *fs) if fs else rows.reshape(rows.shape[0], -1)
    for axis, f in enumerate(fs, start=2):
        y = _along(y, axis, f)
    return y.reshape(rows.shape)


def _along(y: torch.Tensor, axis: int, order: int) -> torch.Tensor:
    """Multiply y by H_order along `axis`: out_j = sum_i H[i, j] y_i, the i in increasing order.
    Each step adds +-y_i to all `order` outputs at once: multiplying by +-1 is exact and a + (-b)
    is a - b in IEEE arithmetic, so these are the sums and differences written out one by one."""
    if order == 2:
        parts = y.unbind(axis)
        return torch.stack((parts[0] + parts[1], parts[0] - parts[1]), dim=axis)
    h = paley(order).to(y.device, y.dtype)  # (order, order) of +-1
    z = y.movedim(axis, -1)  # (..., order)
    acc = z[..., :1] * h[0]  # (..., order): out_j = H[0, j] y_0
    for i in range(1, order):
        acc = acc + z[..., i : i + 1] * h[i]
    return acc.movedim(-1, axis)
