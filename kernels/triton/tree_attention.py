"""Tree attention over a packed forest (OpenAI Triton), cascade style.

A forest is a list of segments (start row, length, parent): system prompt -> material -> question.
A query attends to every row of its ancestor segments and causally to its own segment. The work is
split per *key segment*: one work item holds a segment's keys and every query that sees them, its
own rows (causal) and all rows of its descendants (full). A prefix's keys are therefore read once
for all the branches that share it, not once per branch (the cascade / Hydragen idea).

Each work item writes, per query and head, the online-softmax partial (m, l, acc) of its segment
at the segment's depth ("level"); a second kernel folds the levels of each query in the fixed
order 0, 1, 2, ... into the output. Levels a query does not have stay (m=-inf, l=0, acc=0), which
the fold leaves exactly unchanged.

Batch invariance: a query's partial at a level depends only on its own q row, the segment's keys
and its visibility limit. Keys are walked in fixed BLOCK_N steps from the segment's first row, every
tile has the same shape whatever is packed, key blocks past a query's limit are exact no-ops for
it (p = 0, alpha = 1), and the fold order is fixed. So a query gets the same bits whether its tree
is alone or packed with others, at any row offset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels.triton import launch_options


@dataclass
class TreeLayout:
    """Work items and query lists for the kernels; every tensor int32 on the attention's device.

    item_key_start/item_key_len/item_level: (W,)  the key segment of each work item and its depth
    q_index: (E,)  row of `q` for each (item, query) entry; entries of an item are contiguous
    q_limit: (E,)  the entry sees keys [0, q_limit] of its item's segment
    q_slot:  (E,)  output row of the entry
    block_item/block_first/block_count: (B,)  entries [first, first + count) of item `block_item`
    """
    item_key_start: torch.Tensor
    item_key_len: torch.Tensor
    item_level: torch.Tensor
    q_index: torch.Tensor
    q_limit: torch.Tensor
    q_slot: torch.Tensor
    block_item: torch.Tensor
    block_first: torch.Tensor
    block_count: torch.Tensor
    num_slots: int  # output rows
    levels: int  # deepest segment + 1
    block_m: int

    def to(self, device) -> "TreeLayout":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return TreeLayout(**moved)


def _depths(segments: Sequence[tuple[int, int, int]]) -> list[int]:
    depth = []
    for _, _, parent in segments:
        if parent >= len(depth):
            raise ValueError("a segment's parent must come before it")
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def build_layout(segments: Sequence[tuple[int, int, int]], queries: Sequence[tuple[int, int]] | None = None,
                 block_m: int = 16) -> TreeLayout:
    """segments: (start row, length, parent index or -1), parents first.

    queries: (segment index, offset in it) of each output row; None means every row of every
    segment, output row = packed row (all-rows attention). Answer-only attention passes the last
    row of each branch, output row i = queries[i] and q row i.
    """
    depth = _depths(segments)
    if queries is None:
        queries = [(s, i) for s, (_, length, _) in enumerate(segments) for i in range(length)]
        q_rows = [segments[s][0] + i for s, i in queries]
    else:
        q_rows = list(range(len(queries)))
    # entries[a]: (q row, limit, slot) of every query that sees segment a, in output order
    entries: list[list[tuple[int, int, int]]] = [[] for _ in segments]
    for slot, ((s, offset), q_row) in enumerate(zip(queries, q_rows)):
        if not 0 <= offset < segments[s][1]:
            raise ValueError(f"query offset {offset} outside segment {s} of length {segments[s][1]}")
        entries[s].append((q_row, offset, slot))  # own segment: causal
        a = segments[s][2]
        while a >= 0:
            entries[a].append((q_row, segments[a][1] - 1, slot))  # ancestor: all of it
            a = segments[a][2]

    items, flat, blocks = [], [], []
    for a, seen in enumerate(entries):
        if not seen:
            continue
        for first in range(0, len(seen), block_m):
            blocks.append((len(items), len(flat) + first, min(block_m, len(seen) - first)))
        items.append((segments[a][0], segments[a][1], depth[a]))
        flat.extend(seen)

    def col(rows, i):
        return torch.tensor([r[i] for r in rows], dtype=torch.int32)

    return TreeLayout(
        item_key_start=col(items, 0), item_key_len=col(items, 1), item_level=col(items, 2),
        q_index=col(flat, 0), q_limit=col(flat, 1), q_slot=col(flat, 2),
        block_item=col(blocks, 0), block_first=col(blocks, 1), block_count=col(blocks, 2),
        num_slots=len(queries), levels=max(depth, default=0) + 1, block_m=block_m,
    )


@triton.jit
def _segment_partial_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, acc_ptr,
    block_item_ptr, block_first_ptr, block_count_ptr,
    item_key_start_ptr, item_level_ptr, q_index_ptr, q_limit_ptr, q_slot_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    sm_scale, head_dim, group, num_heads, levels,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group  # grouped-query attention
    item = tl.load(block_item_ptr + block)
    first = tl.load(block_first_ptr + block)
    count = tl.load(block_count_ptr + block)
    key_start = tl.load(item_key_start_ptr + item)
    level = tl.load(item_level_ptr + item)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < count
    d_ok = offs_d < head_dim
    q_row = tl.load(q_index_ptr + first + offs_m, mask=row_ok, other=0)
    limit = tl.load(q_limit_ptr + first + offs_m, mask=row_ok, other=0)  # padding rows see key 0
    q = tl.load(q_ptr + q_row[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_keys = tl.max(limit, axis=0) + 1  # keys past every limit in the block are skipped
    for n0 in range(0, n_keys, BLOCK_N):
        keys = n0 + offs_n
        key_ok = keys < n_keys
        k = tl.load(k_ptr + (key_start + keys)[None, :] * stride_kn + kv_head * stride_kh + offs_d[:, None],
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_ptr + (key_start + keys)[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, k, input_precision="ieee") * sm_scale  # (BLOCK_M, BLOCK_N)
        s = tl.where(keys[None, :] <= limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    slot = tl.load(q_slot_ptr + first + offs_m, mask=row_ok, other=0)
    stat = (slot * levels + level) * num_heads + head  # (BLOCK_M,) into (slots, levels, heads)
    tl.store(m_ptr + stat, m_i, mask=row_ok)
    tl.store(l_ptr + stat, l_i, mask=row_ok)
    tl.store(acc_ptr + stat[:, None] * head_dim + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _fold_levels_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, num_slots, num_heads, head_dim, stride_on, stride_oh,
    LEVELS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_slots
    tile_ok = row_ok[:, None] & (offs_d < head_dim)[None, :]
    stat = rows * LEVELS * num_heads + head  # level 0: every query's tree root (or itself)
    m = tl.load(m_ptr + stat, mask=row_ok, other=0.0)
    l = tl.load(l_ptr + stat, mask=row_ok, other=1.0)
    acc = tl.load(acc_ptr + stat[:, None] * head_dim + offs_d[None, :], mask=tile_ok, other=0.0)
    for level in tl.static_range(1, LEVELS):
        st = stat + level * num_heads
        m_j = tl.load(m_ptr + st, mask=row_ok, other=float("-inf"))
        l_j = tl.load(l_ptr + st, mask=row_ok, other=0.0)
        acc_j = tl.load(acc_ptr + st[:, None] * head_dim + offs_d[None, :], mask=tile_ok, other=0.0)
        m_new = tl.maximum(m, m_j)
        a = tl.exp(m - m_new)
        b = tl.exp(m_j - m_new)
        l = l * a + l_j * b
        acc = acc * a[:, None] + acc_j * b[:, None]
        m = m_new
    tl.store(out_ptr + rows[:, None] * stride_on + head * stride_oh + offs_d[None, :], acc / l[:, None], mask=tile_ok)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q (Nq, Hq, D), k and v (N, Hkv, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]} "
                         f"with equal head_dim ({q.shape[2]} vs {k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype == torch.float32):
        raise TypeError(f"tree_attention runs in float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("tree_attention needs a unit stride along head_dim")
    if not (q.device == k.device == v.device == layout.q_index.device):
        raise ValueError("q, k, v and the layout must be on one device")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout,
                   block_n: int = 64, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """q: (Nq, Hq, D); k, v: (N, Hkv, D) float32 -> (layout.num_slots, Hq, D)."""
    _check(q, k, v, layout)
    slots, heads, dim = layout.num_slots, q.shape[1], q.shape[2]
    m = torch.full((slots, layout.levels, heads), float("-inf"), device=q.device)
    l = torch.zeros((slots, layout.levels, heads), device=q.device)
    acc = torch.zeros((slots, layout.levels, heads, dim), device=q.device)
    out = torch.empty((slots, heads, dim), device=q.device)
    if slots == 0:
        return out
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot's inner size is at least 16 on a GPU
    launch = launch_options(q.device, num_warps, num_stages)
    _segment_partial_kernel[(layout.block_item.numel(), heads)](
        q, k, v, m, l, acc,
        layout.block_item, layout.block_first, layout.block_count,
        layout.item_key_start, layout.item_level, layout.q_index, layout.q_limit, layout.q_slot,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dim ** -0.5, dim, heads // k.shape[1], heads, layout.levels,
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_D=block_d, **launch,
    )
    _fold_levels_kernel[(triton.cdiv(slots, layout.block_m), heads)](
        m, l, acc, out, slots, heads, dim, out.stride(0), out.stride(1),
        LEVELS=layout.levels, BLOCK_M=layout.block_m, BLOCK_D=block_d, **launch,
    )
    return out


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """The same attention, written plainly: a dense visibility mask from the layout, softmax, sum."""
    n = k.shape[0]
    visible = torch.zeros((layout.num_slots, n), dtype=torch.bool)
    slot_q = torch.zeros(layout.num_slots, dtype=torch.long)
    starts = layout.item_key_start.long().cpu()
    for item, first, count in zip(*(t.long().cpu().tolist() for t in (layout.block_item, layout.block_first,
                                                                       layout.block_count))):
        for e in range(first, first + count):
            slot, limit = int(layout.q_slot[e]), int(layout.q_limit[e])
            visible[slot, starts[item] : starts[item] + limit + 1] = True
            slot_q[slot] = int(layout.q_index[e])
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, N, D)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qq = q[slot_q.to(q.device)].transpose(0, 1)  # (Hq, slots, D)
    scores = (qq @ kk.transpose(1, 2)) * q.shape[2] ** -0.5  # (Hq, slots, N)
    scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    return (scores.softmax(-1) @ vv).transpose(0, 1)  # (slots, Hq, D)
