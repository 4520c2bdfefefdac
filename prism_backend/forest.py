"""The forest's data types, shared by every layer: a request's token ids (EncodedRequest) and the
packed forest of shared prefixes the model runs (Forest, Segment, ForestStats).

    root   (system prompt)       shared by every request with the same system prompt
     └ trunk (material)          shared by every request with the same system prompt and material
        └ branch (question)      shared by identical questions about the same material

The engine builds a Forest from a batch of EncodedRequests (engine/forest_builder.py), with root
and trunk cut into blocks, the unit of the prefix cache and of chunked prefill; the model runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations here: the tokenizer step imports EncodedRequest without torch
    import torch


@dataclass(frozen=True)
class EncodedRequest:
    """Token ids of one request, ready for the forest."""

    root: tuple[int, ...]
    trunk: tuple[int, ...]
    branches: tuple[tuple[int, ...], ...]  # one per task
    candidates: tuple[tuple[int, ...], ...]  # answer-letter token ids, one tuple per task

    def prompt_ids(self, i: int) -> list[int]:
        return [*self.root, *self.trunk, *self.branches[i]]


@dataclass
class Segment:
    start: int  # first row in the packed sequence
    length: int
    position: int  # position id of the first token
    parent: int  # index of the parent segment, -1 for a tree's first segment
    key_rows: torch.Tensor  # (ancestor rows + own rows,) rows this segment's tokens attend to
    is_branch: bool
    cache_key: bytes | None = None  # content-hash chain of a root/trunk block; None for branches

    @property
    def prefix_length(self) -> int:
        """Keys before this segment's own tokens (all visible to each of its queries)."""
        return int(self.key_rows.numel()) - self.length


@dataclass
class ForestStats:
    requests: int = 0
    tasks: int = 0
    tokens_computed: int = 0  # unique tokens run through the model
    tokens_generic: int = 0  # tokens a per-question generic path would run
    tokens_cached: int = 0  # unique tokens whose K/V came from the prefix cache
    candidates: int = 0  # summed over tasks
    fallback_tasks: int = 0  # tasks scored over the full vocabulary
    chunks: int = 0  # passes over the layers (prefill chunks)
    max_chunk_rows: int = 0  # rows computed in the largest pass: bounds activation memory


@dataclass
class Forest:
    token_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    segments: list[Segment]  # cached ones first, then the computed ones; parents before children
    answer_rows: torch.Tensor  # (A,) last row of each unique branch
    answers: list[list[int]]  # answers[r][t] -> index into answer_rows for request r, task t
    stats: ForestStats = field(default_factory=ForestStats)
    cached_rows: int = 0  # rows [0, cached_rows) come from the cache, not computed
    cached_entries: list = field(default_factory=list)  # engine/prefix_cache.CacheEntry of each, in row order


