"""Tensor parallelism inside one model instance: the head/column split and the process group.

Rank 0 is the engine in the Triton instance; ranks 1..N-1 are worker processes it starts
(`python -m prism_backend.engine.tp_worker`). All ranks run the same forest forward on their shard:

    q/k/v, gate/up   column-parallel: each rank holds whole KV groups (their KV heads and the
                     query heads that read them) and a slice of the MLP columns; no communication
    o, down          row-parallel: each rank multiplies its slice of the input; the INT8 partial
                     products are all-reduced as int32 (exact) before dequantisation, and the
                     per-token activation scales are all-reduced with MAX (exact), so every rank
                     dequantises the very numbers TP = 1 would: bit-identical probabilities.

Everything else (embeddings, norms, residuals) is replicated; only rank 0 scores candidates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ConfigError
from .spec import ModelSpec
from .rotation import down_block


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    kv_heads: tuple[int, int]  # [first, end) of this rank's KV heads
    q_heads: tuple[int, int]  # the query heads of those KV groups
    columns: tuple[int, int]  # [first, end) of the MLP intermediate columns


# torch's CPU element-wise kernels run 2 SIMD vectors (32 floats with AVX-512) per step and finish
# a row's remainder with scalar code, which rounds some functions (silu's exp, fused multiply-adds)
# differently. Shard widths that are multiples of this keep every element on the same code path
# as in the unsplit layer, which is what makes TP bit-identical beyond the exact integer products.
WIDTH_ALIGN = 32


def plan_shards(spec: ModelSpec, world: int) -> list[Shard]:
    """Whole KV groups per rank (as even as possible: 3 KV heads on 2 ranks -> 1 + 2) and MLP
    column slices cut at multiples of WIDTH_ALIGN."""
    if spec.num_kv_heads < world:
        raise ConfigError(
            f"tp_size {world} is larger than the model's {spec.num_kv_heads} KV heads; KV heads are split, "
            f"not replicated, so use tp_size <= {spec.num_kv_heads}")
    group = spec.num_heads // spec.num_kv_heads
    if (group * spec.head_dim) % WIDTH_ALIGN:
        raise ConfigError(f"tensor parallelism needs a KV group's width (here {group} x {spec.head_dim}) to be "
                          f"a multiple of {WIDTH_ALIGN} for bit-identical results; use tp_size 1 for this model")
    # ... and multiples of the int8 precision's online Hadamard blocks, so that every rank rotates whole blocks
    align = max(WIDTH_ALIGN, down_block(spec.intermediate_size))
    cuts = [0] + [spec.intermediate_size * r // world // align * align for r in range(1, world)] \
        + [spec.intermediate_size]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ConfigError(f"the MLP width {spec.intermediate_size} is too narrow to split {world} ways "
                          f"in multiples of {align}")
    shards = []
    for r in range(world):
        g0, g1 = spec.num_kv_heads * r // world, spec.num_kv_heads * (r + 1) // world
        shards.append(Shard(r, world, (g0, g1), (g0 * group, g1 * group), (cuts[r], cuts[r + 1])))
    return shards


def local_spec(spec: ModelSpec, shard: Shard | None) -> ModelSpec:
    """The shapes this rank computes with: its heads and MLP columns."""
    if shard is None:
        return spec
    return dataclasses.replace(spec, num_heads=shard.q_heads[1] - shard.q_heads[0],
                               num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
                               intermediate_size=shard.columns[1] - shard.columns[0])


def shard_stats(stats: list[dict], spec: ModelSpec, shard: Shard | None) -> list[dict]:
    """Calibration statistics of the full model -> this rank's input channels of o and down."""
    if shard is None:
        return stats
    q = slice(shard.q_heads[0] * spec.head_dim, shard.q_heads[1] * spec.head_dim)
    c = slice(*shard.columns)
    return [{**s, "o": s["o"][q], "down": s["down"][c]} for s in stats]


def shard_integers(integers: list[dict], spec: ModelSpec, shard: Shard | None) -> list[dict]:
    """8-bit integers, scales and corrections of the full model's projections (engine/calibration.py)
    -> this rank's: rows of q/k/v and gate/up (with their scales and corrections), input columns of o
    and down (whose per-output-channel scales and corrections are the full rows': every rank's
    partial sums share them, and the correction is added once, after the all-reduce)."""
    if shard is None:
        return integers
    D, I = spec.head_dim, spec.intermediate_size
    q = slice(shard.q_heads[0] * D, shard.q_heads[1] * D)
    kv = slice(shard.kv_heads[0] * D, shard.kv_heads[1] * D)
    qkv_rows = torch.cat([torch.arange(spec.q_dim)[q], spec.q_dim + torch.arange(spec.kv_dim)[kv],
                          spec.q_dim + spec.kv_dim + torch.arange(spec.kv_dim)[kv]])
    columns = torch.arange(I)[slice(*shard.columns)]
    gate_up_rows = torch.cat([columns, I + columns])
    local = []
    for layer in integers:
        local.append({
            "qkv": tuple(t[qkv_rows] for t in layer["qkv"]),
            "gate_up": tuple(t[gate_up_rows] for t in layer["gate_up"]),
            "o": (layer["o"][0][:, q], *layer["o"][1:]),
            "down": (layer["down"][0][:, slice(*shard.columns)], *layer["down"][1:]),
        })
    return local


class TPGroup:
    """The gloo process group of one model instance (rank 0 = the engine)."""

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float = 300):
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

