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

from ..config import ConfigError, EngineConfig
from ..errors import RequestError, or_error, run_valid
from ..forest import EncodedRequest, ForestStats
from ..model.scoring import FULL_VOCABULARY, score_forest
from ..reproducibility import torch_threads
from .runner import ForestRunner, build_model
from .tp_worker import TPWorkers


@dataclass(frozen=True)
class TaskScore:
    probabilities: np.ndarray  # (C,) float32, in option order
    path: str  # "candidates" or "full_vocabulary"


# What the built model depends on: engines equal in these may share one model.
WEIGHT_FIELDS = ("model_dir", "precision", "keep_exact", "act_passes", "weight_passes", "smooth_alpha", "kernels")


class DecisionEngine:
    def __init__(self, config: EngineConfig, share_weights_with: DecisionEngine | None = None):
        """share_weights_with: an engine (without TP) whose model this one uses instead of building
        its own, when the two configs differ only outside WEIGHT_FIELDS (cache, chunking, limits)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.workers: TPWorkers | None = None
        if share_weights_with is not None:
            _check_shareable(config, share_weights_with.config)
            self.spec, model, self.lm_head = share_weights_with.spec, share_weights_with.model, share_weights_with.lm_head
        else:
            group = None
            if config.tp_size > 1:
                self.workers = TPWorkers(config)
                group = self.workers.group
            try:
                self.spec, model, self.lm_head = build_model(config, group)
            except BaseException:
                self.close()
                raise
        self.model = model  # this rank's ForestTransformer
        self.runner = ForestRunner(config, self.spec, model)
        # with TP, one forest at a time: every rank's collectives must line up
        self._lock = threading.Lock() if self.workers is not None else contextlib.nullcontext()

    @property
    def cache(self):
        return self.runner.cache

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

    def _validated(self, req: EncodedRequest) -> EncodedRequest:
        self.validate(req)
        return req

    def score(self, requests: list[EncodedRequest], use_cache: bool = True,
              threads: int = 0) -> tuple[list[list[TaskScore] | RequestError], ForestStats]:
        """Per request its task scores, or the RequestError that rejected it alone; forest statistics.
        use_cache=False computes every block and leaves the prefix cache as it was; threads > 0 runs
        this forward (on every TP rank) at that thread count instead of the configured one. Both
        exist for the startup self-check, which compares recomputed results at two thread counts."""
        return run_valid([or_error(self._validated, req) for req in requests],
                         lambda batch: self._score_valid(batch, use_cache, threads))

    def _score_valid(self, batch: list[EncodedRequest], use_cache: bool,
                     threads: int) -> tuple[list[list[TaskScore]], ForestStats]:
        if not batch:
            return [], ForestStats(requests=0)
        with self._lock, torch_threads(threads):
            if self.workers is not None:
                self.workers.broadcast((batch, use_cache, threads))  # every rank runs the same forest
            forest, hidden = self.runner.forward(batch, use_cache)  # (A, H)
        scored = score_forest(hidden, self.lm_head, forest.answers, [r.candidates for r in batch],
                              self.config.max_candidates)
        forest.stats.fallback_tasks += sum(path == FULL_VOCABULARY for tasks in scored for _, path in tasks)
        return [[TaskScore(probs, path) for probs, path in tasks] for tasks in scored], forest.stats


def _check_shareable(config: EngineConfig, other: EngineConfig) -> None:
    if config.tp_size > 1 or other.tp_size > 1:
        raise ConfigError("engines share weights only without tensor parallelism (tp_size 1)")
    differ = [name for name in WEIGHT_FIELDS if getattr(config, name) != getattr(other, name)]
    if differ:
        raise ConfigError(f"cannot share weights built with different {differ}")
