"""Pack a batch of requests into one forest of shared prefixes (the types: prism_backend/forest.py).

    root   (system prompt)       shared by every request with the same system prompt
     └ trunk (material)          shared by every request with the same system prompt and material
        └ branch (question)      shared by identical questions about the same material

Root and trunk are cut into blocks of `block_tokens`, each a segment whose parent is the block
before it. Blocks are the unit of the prefix cache (prefix_cache.py, beside this module) and of chunked prefill, and
because they exist whether or not a cache or chunking is in use, every segment's computation has
the same shape either way: that is what makes cached, chunked and plain runs bit-identical.

The input is one `EncodedRequest` per request: token ids already cut into root, trunk and branches
(text/prompt.py makes them; the forest never sees text).

Identical segments are found by their parent and full token content (a dict keyed by the id
tuples, so a hash collision can never merge different text). Every unique segment is computed
once; its rows are contiguous in the packed sequence, and its positions continue from its parent's
end. Blocks found in the prefix cache are not computed: they come first in the packed rows
(`cached_rows`) and their K/V is taken from the cache entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..forest import EncodedRequest, Forest, ForestStats, Segment
from .prefix_cache import ROOT_KEY, CacheEntry, PrefixCache, block_key


@dataclass
class _Planned:
    tokens: tuple[int, ...]
    parent: int  # index into the plan
    is_branch: bool
    cache_key: bytes | None
    entry: CacheEntry | None  # set when the block's K/V is in the cache


def _blocks(tokens: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [tokens[i : i + size] for i in range(0, len(tokens), size)]


def build_forest(requests: list[EncodedRequest], block_tokens: int = EngineConfig.kv_block_tokens,
                 cache: PrefixCache | None = None) -> Forest:
    plan: list[_Planned] = []
    index_of: dict[tuple, int] = {}
    answer_of: dict[int, int] = {}  # plan index of a branch -> answer index
    stats = ForestStats(requests=len(requests))
    answers = []

    def add(parent: int, tokens: tuple[int, ...], is_branch: bool, key: bytes | None, entry) -> int:
        dedup = (parent, is_branch, tokens)
        if dedup not in index_of:
            index_of[dedup] = len(plan)
            plan.append(_Planned(tokens, parent, is_branch, key, entry))
        return index_of[dedup]

    for req in requests:
        # the prefix as blocks, each keyed by the chain of content hashes up to it
        chain, key = [], ROOT_KEY
        for part in (req.root, req.trunk):
            for tokens in _blocks(part, block_tokens):
                key = block_key(key, tokens)
                chain.append((key, tokens))
        hits = cache.lookup_chain(chain) if cache is not None else []
        parent = -1
        for i, (key, tokens) in enumerate(chain):
            # a hit is used only under a cached parent: cached rows must form whole ancestries
            usable = i < len(hits) and (parent < 0 or plan[parent].entry is not None)
            parent = add(parent, tokens, False, key, hits[i] if usable else None)
        request_answers = []
        for branch_ids, cands in zip(req.branches, req.candidates):
            if not branch_ids:
                raise ValueError("a branch must hold at least the answer position")
            seg = add(parent, tuple(branch_ids), True, None, None)
            if seg not in answer_of:
                answer_of[seg] = len(answer_of)
            request_answers.append(answer_of[seg])
            stats.tasks += 1
            stats.candidates += len(cands)
            stats.tokens_generic += len(req.root) + len(req.trunk) + len(branch_ids)
        answers.append(request_answers)
    return _pack(plan, answer_of, answers, stats)


def _pack(plan: list[_Planned], answer_of: dict[int, int], answers, stats: ForestStats) -> Forest:
    """Rows: cached blocks first (a cached block's parent is cached too), then the computed
    segments in plan order; both keep parents before children."""
    order = [i for i, p in enumerate(plan) if p.entry is not None] + [i for i, p in enumerate(plan) if p.entry is None]
    new_index = {old: new for new, old in enumerate(order)}
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    answer_rows = [0] * len(answer_of)
    for old in order:
        p = plan[old]
        start = len(ids)
        parent = new_index[p.parent] if p.parent >= 0 else -1
        if parent >= 0:
            position = segments[parent].position + segments[parent].length
            prefix = segments[parent].key_rows
        else:
            position, prefix = 0, torch.empty(0, dtype=torch.long)
        own = torch.arange(start, start + len(p.tokens), dtype=torch.long)
        ids.extend(p.tokens)
        positions.extend(range(position, position + len(p.tokens)))
        segments.append(Segment(start, len(p.tokens), position, parent, torch.cat([prefix, own]), p.is_branch,
                                p.cache_key))
        if old in answer_of:
            answer_rows[answer_of[old]] = start + len(p.tokens) - 1
    cached = [plan[i].entry for i in order if plan[i].entry is not None]
    stats.tokens_cached = sum(len(e.tokens) for e in cached)
    stats.tokens_computed = len(ids) - stats.tokens_cached
    return Forest(
        token_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        segments=segments,
        answer_rows=torch.tensor(answer_rows, dtype=torch.long),
        answers=answers,
        stats=stats,
        cached_rows=stats.tokens_cached,
        cached_entries=cached,
    )
