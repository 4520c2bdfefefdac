"""Candidate-only scoring, and the full-vocabulary fallback.

softmax over the candidates' logits equals the full-vocabulary softmax renormalised over the
candidates (the partition function cancels), so only the candidate rows of the LM head are needed.
Tasks with more candidates than the cap take the full-vocabulary path; both give the same numbers.
"""
from __future__ import annotations

import math

import numpy as np
import torch

CANDIDATES = "candidates"
FULL_VOCABULARY = "full_vocabulary"


def score_answer(hidden: torch.Tensor, lm_head: torch.Tensor, candidates: tuple[int, ...], cap: int):
    """hidden: (H,) final-normed state of one answer position; lm_head: (V, H).

    Returns (probabilities (C,) float32, path name).
    """
    if len(candidates) <= cap:
        rows = lm_head[torch.tensor(candidates, dtype=torch.long)]  # (C, H)
        return _softmax(_logits(rows, hidden)), CANDIDATES
    probs = _softmax(_logits(lm_head, hidden))  # (V,)
    chosen = [float(p) for p in probs[list(candidates)]]
    total = math.fsum(chosen)
    return np.array([p / total for p in chosen], dtype=np.float32), FULL_VOCABULARY


def score_forest(hidden: torch.Tensor, lm_head: torch.Tensor, answers: list[list[int]],
                 candidates: list[tuple[tuple[int, ...], ...]], cap: int) -> list[list[tuple[np.ndarray, str]]]:
    """Every task of a forest's requests in one call. hidden: (A, H) final-normed answer rows;
    answers[r][t]: the row of request r's task t (Forest.answers); candidates[r][t]: its candidate ids.

    Returns per request, per task: (probabilities (C,) float32, path name)."""
    with torch.inference_mode():
        return [[score_answer(hidden[row], lm_head, cands, cap) for row, cands in zip(rows, request)]
                for rows, request in zip(answers, candidates)]


# The logits and the softmax are computed so that their bits depend on nothing but the numbers: a
# float32 product through BLAS (MKL's sgemm) or torch's vectorised exp and sum reduce in an order set
# by the CPU's vector width and vendor, which would make a served probability differ by machine.
ROWS_PER_CHUNK = 4096  # the full-vocabulary path's rows per float64 temporary (~18 MB at H = 576)


def _logits(rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """rows (C, H), hidden (H,) float32 -> (C,) float64: each product of two float32 numbers is exact
    in float64, and cumsum adds them left to right (a sequential scan on the CPU): one order of
    float64 roundings on every machine, whatever the thread count, and closer to the real number
    than a float32 dot product."""
    h = hidden.to(torch.float64)
    return torch.cat([torch.cumsum(chunk.to(torch.float64) * h, dim=-1)[:, -1] for chunk in rows.split(ROWS_PER_CHUNK)])


def _softmax(logits: torch.Tensor) -> np.ndarray:
    """(C,) float64 -> probabilities (C,) float32: exp from the C library (one implementation on every
    x86-64 CPU with FMA), the sum correctly rounded (math.fsum), one rounding to float32 at the end."""
    values = logits.tolist()
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = math.fsum(weights)
    return np.array([w / total for w in weights], dtype=np.float32)
