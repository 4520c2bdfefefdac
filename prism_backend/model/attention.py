"""Tree attention over a packed forest.

Every token attends exactly to its ancestors: the rows of its parent segments and the earlier rows
of its own segment. Three implementations with these semantics, each computing a segment on its
own, so that its result depends only on its own tree, never on what else is packed in the batch:
  - on CPU, Prism's kernel (kernels/cpu/tree_attention.py, `kernels` auto): float32, or integers
    (14-bit q, k; 12-bit v) with exact int32 sums (EngineConfig.attention), with one operation
    order on every x86 CPU kind, thread count and batch (the same bits on an AVX2 EPYC and an
    AVX-512 Xeon), for heads of 64 where the kernel library builds;
  - torch's CPU flash-attention kernel (`kernels` torch, other head sizes, no kernel library):
    thread-count and batch invariant, but its bits follow the CPU's vector width;
  - the Triton-lang kernel (kernels/triton/tree_attention.py, CUDA), which reads each shared prefix
    once for all its branches.
"""
from __future__ import annotations

import torch

from kernels.cpu import tree_attention as cpu_tree_attention

from ..forest import Segment
from .quant import use_triton


def _expand_groups(k: torch.Tensor, v: torch.Tensor, heads: int):
    """(rows, Hkv, D) -> (rows, Hq, D) once per layer, so that each segment gathers its keys with
    the query heads' layout already (the same values and the same contiguous (Lk, Hq, D) tensors
    as gathering first and expanding after, without the second copy)."""
    group = heads // k.shape[1]
    return (k, v) if group == 1 else (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def visibility_mask(lq: int, lk: int, prefix: int) -> torch.Tensor:
    """(Lq, Lk) additive mask of a segment below a prefix: all `prefix` ancestors, own rows causally."""
    visible = torch.arange(lk)[None, :] <= (prefix + torch.arange(lq))[:, None]
    return torch.zeros(lq, lk).masked_fill_(~visible, float("-inf"))


def key_selector(rows: torch.Tensor) -> slice | torch.Tensor:
    """A segment's key rows as a slice when they are one ascending run (a tree's first segment and
    every trunk block below it: most of a forest's rows), else the index tensor itself. Indexing
    with the slice is a view of the same values with the same strides, so attention reads the same
    numbers without copying (rows so far x Hq x D) floats per segment and layer."""
    first, count = int(rows[0]), rows.numel()
    if torch.equal(rows, torch.arange(first, first + count)):
        return slice(first, first + count)
    return rows


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, causal: bool,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: (Lq, Hq, D); k, v: (Lk, Hkv, D) -> (Lq, Hq, D).

    With `causal`, query i sees keys [0, prefix + i]; otherwise every key. `mask`: the segment's
    visibility_mask when the caller already has it (it is the same in every layer).

    Thread-count invariance, by construction: this is torch's CPU flash-attention kernel called
    directly (not through F.scaled_dot_product_attention's backend choice). It splits its work
    into (head, block of query rows) items, each run start to end by one thread: the query block's
    keys in fixed blocks of 512 from the first, an online softmax in that order, and two sgemm
    calls per key block. Which thread runs an item never changes its arithmetic, and the sgemm
    calls reduce in a thread-count-independent order because MKL runs in strict CNR mode
    (reproducibility.py). The kernel wants as many K/V heads as query heads, so GQA groups are expanded.
    """
    lq, lk = q.shape[0], k.shape[0]
    k, v = _expand_groups(k, v, q.shape[1])  # a no-op where the caller expanded them once per layer
    own_rows_only = causal and lq > 1 and prefix == 0  # the kernel's causal mode: query i sees keys [0, i]
    if not (causal and lq > 1 and prefix > 0):
        mask = None
    elif mask is None:
        mask = visibility_mask(lq, lk, prefix)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, own_rows_only,
        attn_mask=mask,
    )[0]  # (1, Hq, Lq, D)
    return out[0].transpose(0, 1)


def answer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branches: list[Segment]) -> torch.Tensor:
    """Only the answer (last) row of each branch: q: (A, Hq, D) in branch order -> (A, Hq, D)."""
    out = torch.empty_like(q)
    k, v = _expand_groups(k, v, q.shape[1])
    for i, seg in enumerate(branches):
        out[i : i + 1] = _sdpa(q[i : i + 1], k[seg.key_rows], v[seg.key_rows], seg.prefix_length, causal=False)
    return out


class ForestAttention:
    """Attention for the segments `computed` of a forest (contiguous rows from the first one's
    start), in every layer: all their rows (`rows`) and, in the last layer, only the answer rows of
    `branches` (`answers`). Keys and values cover every row up to the computed ones' end (cached
    and earlier-chunk rows included). Dispatches per EngineConfig.kernels; the kernels' work layout
    is built once per forward, not once per layer."""

    def __init__(self, segments: list[Segment], computed: list[int], branches: list[int], kernels: str,
                 device: torch.device, head_dim: int, integer: bool = False):
        """integer: Prism's CPU kernel in its integer form (EngineConfig.attention), where it runs."""
        self.segments = segments
        self.integer = integer
        self.computed = computed
        self.branches = branches
        self.first_row = segments[computed[0]].start
        self.kernel_layouts = self.cpu_tables = None
        if kernels == "auto" and device.type == "cpu" and cpu_tree_attention.available(head_dim):
            # (first query row, rows, key rows, keys before its own) per segment: all rows, then answers
            rows = [(segments[i].start - self.first_row, segments[i].length, segments[i].key_rows,
                     segments[i].prefix_length) for i in computed]
            answers = [(n, 1, segments[i].key_rows, segments[i].key_rows.numel() - 1) for n, i in enumerate(branches)]
            self.cpu_tables = (cpu_tree_attention.segment_table(rows), cpu_tree_attention.segment_table(answers))
        elif use_triton(kernels, torch.empty(0, device=device)):
            from kernels.triton.tree_attention import build_layout

            tuples = [(seg.start, seg.length, seg.parent) for seg in segments]
            rows = [(i, offset) for i in computed for offset in range(segments[i].length)]
            answers = [(i, segments[i].length - 1) for i in branches]
            self.kernel_layouts = (build_layout(tuples, rows).to(device), build_layout(tuples, answers).to(device))
        else:  # the masks of the segments below a prefix and every segment's keys, once for every layer
            self.masks = {i: visibility_mask(segments[i].length, segments[i].key_rows.numel(), segments[i].prefix_length)
                          for i in computed if segments[i].length > 1 and segments[i].prefix_length > 0}
            self.keys = {i: key_selector(segments[i].key_rows) for i in computed}

    def rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (n, Hq, D) of the computed rows; k, v: (rows so far, Hkv, D) -> (n, Hq, D)."""
        if self.cpu_tables is not None:
            return cpu_tree_attention.tree_attention(q, k, v, *self.cpu_tables[0], integer=self.integer)
        if self.kernel_layouts is not None:
            from kernels.triton.tree_attention import tree_attention as tree_attention_kernel

            return tree_attention_kernel(q, k, v, self.kernel_layouts[0])
        out = torch.empty_like(q)
        k, v = _expand_groups(k, v, q.shape[1])
        for i in self.computed:
            seg = self.segments[i]
            local = slice(seg.start - self.first_row, seg.start - self.first_row + seg.length)
            keys = self.keys[i]
            out[local] = _sdpa(q[local], k[keys], v[keys], seg.prefix_length, causal=True, mask=self.masks.get(i))
        return out

    def answers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (A, Hq, D) of the answer rows; k, v: (rows so far, Hkv, D) -> (A, Hq, D)."""
        if self.cpu_tables is not None:
            return cpu_tree_attention.tree_attention(q, k, v, *self.cpu_tables[1], integer=self.integer)
        if self.kernel_layouts is not None:
            from kernels.triton.tree_attention import tree_attention as tree_attention_kernel

            return tree_attention_kernel(q, k, v, self.kernel_layouts[1])
        return answer_attention(q, k, v, [self.segments[i] for i in self.branches])
