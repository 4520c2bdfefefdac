"""The decision engine: a batch of tokenized requests -> candidate probabilities + statistics.

Usable without Triton: `DecisionEngine(config).score([EncodedRequest, ...])`. Each request is
validated on its own; an invalid one gets its RequestError back while the rest are scored.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch

from .config import EngineConfig
from .errors import RequestError
from .forest import ForestStats
from .prompt import EncodedRequest
from .reproducibility import torch_threads
from .runner import ForestRunner, build_model
from .scoring import FULL_VOCABULARY, score_answer
from .tp_worker import TPWorkers


@dataclass(frozen=True)
class TaskScore:
    probabilities: np.ndarray  # (C,) float32, in option order
    path: str  # "candidates" or "full_vocabulary"


class EngineUnavailable(RuntimeError):
    """The engine cannot score any more (a tensor-parallel worker died); the model must be reloaded."""


class DecisionEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.workers: TPWorkers | None = None
        group = None
        if config.tp_size > 1:
            self.workers = TPWorkers(config)
            group = self.workers.group
        try:
            self.spec, model, self.lm_head = build_model(config, group)
        except BaseException:
            self.close()
            raise
        self.runner = ForestRunner(config, self.spec, model)
        # with TP, one forest at a time: every rank's collectives must line up
        self._lock = threading.Lock() if self.workers is not None else contextlib.nullcontext()

    @property
    def cache(self):
        return self.runner.cache

    @cache.setter
    def cache(self, value):
        self.runner.cache = value

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); idempotent."""
        if self.workers is not None:
            self.workers.stop()

    def validate(self, req: EncodedRequest) -> None:
        """Raise RequestError naming what is wrong with one tokenized request."""
        cfg, vocab = self.config, self.spec.vocab_size
        if not req.branches:
            raise RequestError("no tasks in the request")
        if len(req.branches) > cfg.max_tasks_per_request:
            raise RequestError(
                f"{len(req.branches)} tasks in one request; the limit is {cfg.max_tasks_per_request}"
            )
        if len(req.candidates) != len(req.branches):
            raise RequestError(
                f"{len(req.branches)} branches but {len(req.candidates)} candidate sets; they must match"
            )
        prefix = len(req.root) + len(req.trunk)
        for t, (branch, cands) in enumerate(zip(req.branches, req.candidates)):
            if not branch:
                raise RequestError(f"task {t}: empty branch; the answer position needs a token")
            if prefix + len(branch) > self.spec.max_context:
                raise RequestError(
                    f"task {t}: prompt of {prefix + len(branch)} tokens exceeds the model's context of "
                    f"{self.spec.max_context} tokens"
                )
            if not 2 <= len(cands) <= cfg.max_options:
                raise RequestError(f"task {t}: {len(cands)} candidates; need 2 to {cfg.max_options}")
            if len(set(cands)) != len(cands):
                raise RequestError(f"task {t}: duplicate candidate token ids")
        for name, ids in (("root", req.root), ("trunk", req.trunk),
                          ("branch", [i for b in req.branches for i in b]),
                          ("candidate", [i for c in req.candidates for i in c])):
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise RequestError(f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def score(self, requests: list[EncodedRequest], use_cache: bool = True,
              threads: int = 0) -> tuple[list[list[TaskScore] | RequestError], ForestStats]:
        """Score each valid request; an invalid one gets its RequestError. use_cache=False computes
        every block and leaves the prefix cache as it was; threads > 0 runs this forward (on every
        TP rank) at that thread count instead of the configured one. Both exist for the startup
        self-check, which must compare recomputed results at two thread counts."""
        results: list[list[TaskScore] | RequestError | None] = [None] * len(requests)
        valid = []
        for i, req in enumerate(requests):
            try:
                self.validate(req)
                valid.append(i)
            except RequestError as exc:
                results[i] = exc
        if not valid:
            return results, ForestStats(requests=0)

        batch = [requests[i] for i in valid]
        with self._lock, torch_threads(threads):
            if self.workers is not None:
                self.workers.broadcast((batch, use_cache, threads))  # every rank runs the same forest
            forest, hidden = self.runner.forward(batch, use_cache)  # (A, H)
        stats = forest.stats
        with torch.inference_mode():
            for i, answers in zip(valid, forest.answers):
                scores = []
                for answer, cands in zip(answers, requests[i].candidates):
                    probs, path = score_answer(hidden[answer], self.lm_head, cands, self.config.max_candidates)
                    stats.fallback_tasks += path == FULL_VOCABULARY
                    scores.append(TaskScore(probs.to(torch.float32).numpy().copy(), path))
                results[i] = scores
        return results, stats
