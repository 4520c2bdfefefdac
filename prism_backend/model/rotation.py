"""Rotate the model so that its activations quantise well to 8 bits (QuaRot's scheme, offline).

Per-token 8-bit activations lose most of their precision to a few outlier channels: the scale is
set by the largest value, the rest round to a handful of levels. An orthogonal Q spreads every
channel over all of them. Rotating the residual stream h -> h Q changes nothing the model computes
if every matrix that reads h reads Qᵀ-rotated inputs and every matrix that writes it writes Q-rotated
outputs, and RMSNorm commutes with Q once its gain is folded into the readers (|h Q| = |h|):

    embedding        E      -> E Q                 (the rows looked up are already rotated)
    q/k/v, gate/up   W      -> diag(g) folded, W Q  (g: the input / post-attention norm's gain)
    o, down          W      -> Qᵀ W                 (their outputs are added to h)
    LM head          L      -> diag(g_final) folded, L Q: its own fp32 matrix even where the
                               checkpoint ties it to E (E is rotated without the gain)

Q = diag(s) H / sqrt(H), H the Hadamard matrix of the hidden size (hadamard.py) and s fixed random
signs. Two more rotations need no counterpart in the residual:
  - per attention head, V's outputs and o's inputs by H_head / sqrt(head_dim): attention mixes V's
    rows with weights that sum to 1, so a rotation of V's columns passes through to o's input;
  - before down: down's input silu(gate) * up cannot be rotated offline (it is computed), so the
    forward multiplies it by a block-diagonal Hadamard online (`online_down`: blocks of
    down_block(I) = 128 coordinates for every MLP width that is a multiple of 128, the same in
    every tensor-parallel shard since shards are cut at multiples of it) and down's weight reads
    W -> W H / block. Blocks rather than one Hadamard of the whole width keep the transform local
    to a shard; measured on the eval slice, the whole width (order 1536) was no more accurate.

All of it is computed in float64 with hadamard.transform (no BLAS; the kernel library's copy of it
where that loads, kernels/cpu/calibration.py: the same operations), then rounded once to float32:
the rotated weights are the same bits on every machine. In exact arithmetic the rotated model is the
same function; in float32 it is equal to rounding (tests/test_rotation.py).
"""
from __future__ import annotations

import math

import torch

from kernels.cpu import calibration as calibration_kernels
from kernels.cpu import rowwise

from ..reproducibility import torch_threads
from . import hadamard
from .loader import ModelWeights
from .spec import ModelSpec

SIGN_SEED = 20261201
MAX_DOWN_BLOCK = 128


def down_block(intermediate_size: int) -> int:
    """Coordinates per block of the online Hadamard before down: 128, or the largest power of two
    dividing a narrower MLP width (tiny test models)."""
    return min(MAX_DOWN_BLOCK, intermediate_size & -intermediate_size)


def residual_block(hidden_size: int) -> int:
    """The order of the residual rotation's Hadamard blocks: the whole hidden size where a Hadamard
    matrix of that order is known (every common size), else the largest power of two dividing it."""
    if hadamard.is_supported(hidden_size):
        return hidden_size
    return hidden_size & -hidden_size


def check_supported(spec: ModelSpec) -> None:
    """The per-head rotation needs a Hadamard matrix of order head_dim (every power of two has one)."""
    if not hadamard.is_supported(spec.head_dim):
        raise ValueError(f"no Hadamard matrix of order head_dim={spec.head_dim} is known to Prism: serve "
                         "this model with precision 'exact'")


def _signs(n: int) -> torch.Tensor:
    """(n,) float64 of +-1, the same on every machine (torch's CPU generator is deterministic)."""
    g = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float64).mul_(2).sub_(1)


def _transform(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """hadamard.transform of float64 x, in the kernel library where it loads (the same operations in
    the same order, so the same bits; ~30x faster than torch's pass per factor row)."""
    order = block or x.shape[-1]
    factors = hadamard.factors(order)
    if factors is None or x.shape[-1] % order or x.dtype != torch.float64 or x.is_cuda or not calibration_kernels.available():
        return hadamard.transform(x, block)
    return calibration_kernels.hadamard_f64(x, order, factors, [hadamard.factor_matrix(f) for f in factors])


def _rotate_rows(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., n) float64 -> x Q, Q = diag(signs) H_block / sqrt(block) (block-diagonal)."""
    return _transform(x * signs, block).div_(math.sqrt(block))


def online_down(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (N, I) float32, down's input -> x H (block-diagonal Hadamard, blocks of `block` =
    ModelWeights.down_block, unnormalised: the per-token quantiser that follows is scale-free, and
    down's weight holds the 1/block). Sums and differences in a fixed order: batch-, thread- and
    CPU-invariant. On CPUs the kernel library's butterfly computes it (the same operations, faster)."""
    if not x.is_cuda and block & (block - 1) == 0 and rowwise.available():
        return rowwise.hadamard_rows(x.reshape(-1, x.shape[-1]), block).view(x.shape)
    return hadamard.transform(x, block)


# One thread: the rotation is ~100k element-wise passes over cache-sized chunks, and with two threads on
# cores another process also uses, each pass waits for the descheduled one (measured on 2 busy cores:
# the embedding's rotation 118 s with 2 threads, 5.8 s with 1). Element-wise: the same bits either way.
@torch_threads(1)
@torch.no_grad()
def rotated_vocab(spec: ModelSpec, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """The rotated embedding and LM head of the unrotated `weights`, (V, H) float32 each: the
    embedding's rows times Q, the LM head's with the final norm's gain folded in first (a new
    tensor even when tied). What rotate() puts in their place."""
    check_supported(spec)
    signs, block = _signs(spec.hidden_size), residual_block(spec.hidden_size)
    f64 = lambda t: t.to(torch.float64)  # noqa: E731
    return {"embed": _rotate_rows(f64(weights.embed), signs, block).float(),
            "lm_head": _rotate_rows(f64(weights.lm_head) * f64(weights.final_norm), signs, block).float()}


@torch_threads(1)
@torch.no_grad()
def rotate(spec: ModelSpec, weights: ModelWeights, block: int | None = None,
           vocab: dict[str, torch.Tensor] | None = None) -> None:
    """Rotate `weights` in place (see the module docstring); afterwards every norm gain is 1,
    `weights.lm_head` is a separate rotated matrix and weights.down_block says the forward must
    apply online_down before each down projection. With tensor parallelism `weights` are one rank's
    shard, `spec` its local shapes and `block` the full model's down_block (every rotation is
    local to a head or to a run of MLP columns, so a shard rotates on its own). vocab: the rotated
    embedding and LM head where the caller has them already (rotated_vocab's, stored: the engine
    maps them from the calibration cache), else computed here. A projection's float weight that is
    None (served from integers computed on the rotated model: engine/runner.py) stays None."""
    check_supported(spec)
    H, D = spec.hidden_size, spec.head_dim
    block_d = block or down_block(spec.intermediate_size)
    block = residual_block(H)
    signs = _signs(H)
    f64 = lambda t: t.to(torch.float64)  # noqa: E731
    rot = lambda t: _rotate_rows(f64(t), signs, block).float()  # noqa: E731  rows of t (..., H) -> t Q
    v_rows = slice(spec.q_dim + spec.kv_dim, spec.q_dim + 2 * spec.kv_dim)
    ones = torch.ones(H)

    vocab = vocab or rotated_vocab(spec, weights)
    weights.embed, weights.lm_head = vocab["embed"], vocab["lm_head"]
    weights.final_norm = ones
    for lw in weights.layers:  # a weight already replaced by its integers (None) is not rotated
        if lw.wqkv is not None:
            wqkv = f64(lw.wqkv) * f64(lw.input_norm)  # (q + 2 kv, H): gain folded
            # V's outputs per KV head: Wv_g -> H_Dᵀ Wv_g, i.e. each column of Wv_g (D,) times H_D / sqrt(D)
            wv = wqkv[v_rows].view(spec.num_kv_heads, D, H).transpose(1, 2)  # (Hkv, H, D)
            wqkv[v_rows] = (_transform(wv) / math.sqrt(D)).transpose(1, 2).reshape(spec.kv_dim, H)
            lw.wqkv = rot(wqkv)
        if lw.bqkv is not None:
            bqkv = f64(lw.bqkv).clone()
            bqkv[v_rows] = _transform(bqkv[v_rows].view(spec.num_kv_heads, D)).div_(math.sqrt(D)).reshape(-1)
            lw.bqkv = bqkv.float()
        lw.input_norm = ones

        if lw.wo is not None:
            # o: its input per query head rotated like V (wo_h -> wo_h H_D / sqrt(D)), its output by Q
            wo = _transform(f64(lw.wo).view(H, spec.num_heads, D)).div_(math.sqrt(D)).reshape(H, spec.q_dim)
            lw.wo = rot(wo.T).T.contiguous()  # Qᵀ wo = (woᵀ Q)ᵀ

        if lw.w_gate_up is not None:
            lw.w_gate_up = rot(f64(lw.w_gate_up) * f64(lw.post_norm))
        lw.post_norm = ones

        if lw.w_down is not None:
            w_down = _transform(f64(lw.w_down), block_d).div_(block_d)  # (H, I): W H / block
            lw.w_down = rot(w_down.T).T.contiguous()
    weights.down_block = block_d
