"""Candidate-only scoring, and the full-vocabulary fallback.

softmax over the candidates' logits equals the full-vocabulary softmax renormalised over the
candidates (the partition function cancels), so only the candidate rows of the LM head are needed.
Tasks with more candidates than the cap take the full-vocabulary path; both give the same numbers.
"""
from __future__ import annotations

import numpy as np
import torch

CANDIDATES = "candidates"
FULL_VOCABULARY = "full_vocabulary"


def score_answer(hidden: torch.Tensor, lm_head: torch.Tensor, candidates: tuple[int, ...], cap: int):
    """hidden: (H,) final-normed state of one answer position; lm_head: (V, H).

    Returns (probabilities (C,) float32, path name).
    """
    index = torch.tensor(candidates, dtype=torch.long)
    if len(candidates) <= cap:
        logits = _logits(lm_head[index], hidden)  # (C,)
        return torch.softmax(logits, dim=-1), CANDIDATES
    probs = torch.softmax(_logits(lm_head, hidden), dim=-1)[index]  # (C,) out of (V,)
    return probs / probs.sum(), FULL_VOCABULARY


def score_forest(hidden: torch.Tensor, lm_head: torch.Tensor, answers: list[list[int]],
                 candidates: list[tuple[tuple[int, ...], ...]], cap: int) -> list[list[tuple[np.ndarray, str]]]:
    """Every task of a forest's requests in one call. hidden: (A, H) final-normed answer rows;
    answers[r][t]: the row of request r's task t (Forest.answers); candidates[r][t]: its candidate ids.

    Returns per request, per task: (probabilities (C,) float32, path name)."""
    with torch.inference_mode():
        return [[_as_numpy(*score_answer(hidden[row], lm_head, cands, cap)) for row, cands in zip(rows, request)]
                for rows, request in zip(answers, candidates)]


def _as_numpy(probs: torch.Tensor, path: str) -> tuple[np.ndarray, str]:
    return probs.to(torch.float32).numpy().copy(), path


def _logits(rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """rows: (C, H), hidden: (H,) -> (C,), as a (1, H) x (H, C) sgemm rather than a matrix-vector
    product: MKL's strict reproducible mode (reproducibility.py) makes ?gemm thread-count invariant, and
    promises nothing for ?gemv."""
    return (hidden[None, :] @ rows.T)[0]
