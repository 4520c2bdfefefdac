"""Pack a batch of requests into one forest of shared prefixes.

    root   (system prompt)       shared by every request with the same system prompt
     └ trunk (material)          shared by every request with the same system prompt and material
        └ branch (question)      shared by identical questions about the same material

Identical segments are found by their full token content (a dict keyed by the id tuples, so a
hash collision can never merge different text). Every unique segment is computed once; its rows
are contiguous in the packed sequence, and its positions continue from its parent's end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .prompt import EncodedRequest


@dataclass
class Segment:
    start: int  # first row in the packed sequence
    length: int
    position: int  # position id of the first token
    parent: int  # index of the parent segment, -1 for a tree's first segment
    key_rows: torch.Tensor  # (ancestor rows + own rows,) rows this segment's tokens attend to
    is_branch: bool

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
    candidates: int = 0  # summed over tasks
    fallback_tasks: int = 0  # tasks scored over the full vocabulary

    @property
    def tokens_saved(self) -> int:
        return self.tokens_generic - self.tokens_computed


@dataclass
class Forest:
    token_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    segments: list[Segment]
    answer_rows: torch.Tensor  # (A,) last row of each unique branch
    answers: list[list[int]]  # answers[r][t] -> index into answer_rows for request r, task t
    stats: ForestStats = field(default_factory=ForestStats)


def build_forest(requests: list[EncodedRequest]) -> Forest:
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    index_of: dict[tuple, int] = {}
    answer_rows: list[int] = []
    answer_of_segment: dict[int, int] = {}

    def add(key: tuple, tokens: tuple[int, ...], parent: int, is_branch: bool) -> int:
        if not tokens:
            return parent  # an empty segment adds nothing; its children hang on its parent
        if key in index_of:
            return index_of[key]
        start = len(ids)
        if parent >= 0:
            p = segments[parent]
            position = p.position + p.length
            prefix = p.key_rows
        else:
            position = 0
            prefix = torch.empty(0, dtype=torch.long)
        own = torch.arange(start, start + len(tokens), dtype=torch.long)
        ids.extend(tokens)
        positions.extend(range(position, position + len(tokens)))
        segments.append(Segment(start, len(tokens), position, parent, torch.cat([prefix, own]), is_branch))
        index_of[key] = len(segments) - 1
        return len(segments) - 1

    stats = ForestStats(requests=len(requests))
    answers = []
    for req in requests:
        root_key = ("root", req.root)
        root = add(root_key, req.root, -1, False)
        trunk_key = ("trunk", req.root, req.trunk)
        trunk = add(trunk_key, req.trunk, root, False)
        request_answers = []
        for branch_ids, cands in zip(req.branches, req.candidates):
            if not branch_ids:
                raise ValueError("a branch must hold at least the answer position")
            seg = add(("branch", req.root, req.trunk, branch_ids), branch_ids, trunk, True)
            if seg not in answer_of_segment:
                s = segments[seg]
                answer_of_segment[seg] = len(answer_rows)
                answer_rows.append(s.start + s.length - 1)
            request_answers.append(answer_of_segment[seg])
            stats.tasks += 1
            stats.candidates += len(cands)
            stats.tokens_generic += len(req.root) + len(req.trunk) + len(branch_ids)
        answers.append(request_answers)
    stats.tokens_computed = len(ids)
    return Forest(
        token_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        segments=segments,
        answer_rows=torch.tensor(answer_rows, dtype=torch.long),
        answers=answers,
        stats=stats,
    )
