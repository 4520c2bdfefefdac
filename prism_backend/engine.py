"""The decision engine: a batch of tokenized requests -> candidate probabilities + statistics.

Usable without Triton: `DecisionEngine(config).score([EncodedRequest, ...])`. Each request is
validated on its own; an invalid one gets its RequestError back while the rest are scored.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import EngineConfig
from .errors import RequestError
from .forest import ForestStats, build_forest
from .loader import load_model
from .model import ForestTransformer
from .prefix_cache import CacheEntry, PrefixCache
from .prompt import EncodedRequest
from .scoring import FULL_VOCABULARY, score_answer


@dataclass(frozen=True)
class TaskScore:
    probabilities: np.ndarray  # (C,) float32, in option order
    path: str  # "candidates" or "full_vocabulary"


class DecisionEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.spec, weights = load_model(config.model_dir)
        self.lm_head = weights.lm_head
        if config.precision == "int8" and config.smooth_alpha > 0:
            self._smooth(weights)
        self.model = ForestTransformer(self.spec, weights, config.precision, config.act_passes, config.kernels)
        self.cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes else None

    def _smooth(self, weights) -> None:
        """Fold SmoothQuant scales (calibrated by an fp32 forward) into the weights before quantising."""
        from transformers import AutoTokenizer

        from .calibration import calibration_requests
        from .smoothing import apply_smoothing, calibrate

        tokenizer = AutoTokenizer.from_pretrained(self.config.model_dir)
        forests = [build_forest([r]) for r in calibration_requests(tokenizer)]
        # fp32 GEMMs reduce in a thread-count-dependent order; calibrating on one thread makes the
        # smoothed int8 weights (and so every probability bit) the same whatever num_threads is.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            stats = calibrate(ForestTransformer(self.spec, weights, "fp32"), forests)
        finally:
            torch.set_num_threads(threads)
        apply_smoothing(self.spec, weights, stats, self.config.smooth_alpha)

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

    def score(self, requests: list[EncodedRequest]) -> tuple[list[list[TaskScore] | RequestError], ForestStats]:
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

        forest = build_forest([requests[i] for i in valid], self.config.kv_block_tokens, self.cache)
        hidden = self._forward(forest)  # (A, H)
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

    def _forward(self, forest) -> torch.Tensor:
        """Answer states (A, H) of a forest: cached blocks' K/V from the cache, the rest computed in
        chunks of at most prefill_chunk_tokens rows (whole segments), each given the K/V before it.
        Every segment sees the same inputs whichever way the rows are split, so the bits agree."""
        segments = forest.segments
        past = None
        if forest.cached_entries:  # per layer (cached rows, Hkv, D)
            k = torch.cat([e.k for e in forest.cached_entries], dim=1)
            v = torch.cat([e.v for e in forest.cached_entries], dim=1)
            past = list(zip(k.unbind(0), v.unbind(0)))
        chunks = self._chunks(list(range(len(forest.cached_entries), len(segments))), segments)
        hidden = []
        for chunk in chunks:
            h, past = self.model.run(forest, chunk, past)
            hidden.append(h)
        forest.stats.chunks = len(chunks)
        forest.stats.max_chunk_rows = max(sum(segments[i].length for i in c) for c in chunks)
        if self.cache is not None:
            self._remember(forest, past)
        return torch.cat(hidden)

    def _chunks(self, computed: list[int], segments) -> list[list[int]]:
        limit = self.config.prefill_chunk_tokens
        chunks, rows = [[]], 0
        for i in computed:
            if limit and chunks[-1] and rows + segments[i].length > limit:
                chunks.append([])
                rows = 0
            chunks[-1].append(i)
            rows += segments[i].length
        return chunks

    def _remember(self, forest, kv) -> None:
        """Insert the computed root/trunk blocks and touch the cached ones, leaf first, so that a
        parent is always more recent than its children (LRU then evicts children first)."""
        cached = len(forest.cached_entries)
        for index in reversed(range(len(forest.segments))):
            seg = forest.segments[index]
            if seg.cache_key is None:
                continue
            if index < cached:
                self.cache.insert(seg.cache_key, forest.cached_entries[index])  # present: a touch
                continue
            rows = slice(seg.start, seg.start + seg.length)
            k = torch.stack([layer_k[rows] for layer_k, _ in kv])  # (layers, n, Hkv, D)
            v = torch.stack([layer_v[rows] for _, layer_v in kv])
            parent = forest.segments[seg.parent].cache_key if seg.parent >= 0 else b""
            tokens = tuple(forest.token_ids[rows].tolist())
            self.cache.insert(seg.cache_key, CacheEntry(tokens, parent, k, v))
