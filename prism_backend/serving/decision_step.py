"""The decision step: token tensors of a batch of requests -> probabilities, through the engine.

The `prism_decision` Triton model and the in-process `DecisionPipeline` both run this class; the
tensors it reads and writes are described in steps.py.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import EngineConfig
from ..engine import calibration
from ..engine.engine import DecisionEngine
from ..errors import RequestError, or_error, run_valid
from ..forest import EncodedRequest
from ..model.exact_matmul import describe_chosen_routes
from ..reproducibility import blas_mode_problem
from .determinism import engine_self_check, synthetic_requests, thread_count_check
from .steps import tensors_to_encoded


class DecisionStep:
    def __init__(self, config: EngineConfig, self_check: bool = True,
                 share_weights_with: DecisionEngine | None = None):
        """self_check: the served model's determinism self-check at start (`_self_check`;
        `self_check_ok` is None when skipped). share_weights_with: see DecisionEngine."""
        self.config = config
        self.engine = DecisionEngine(self.config, share_weights_with)
        self.self_check_ok, self.self_check_problems = None, []
        self.export_check = "not run"  # the self-check against the bits recorded at export (_self_check)
        self.self_check_digests = None  # the self-check's requests, scored alone: their digests (_self_check)
        try:
            if self_check:
                self.self_check_problems = self._self_check()
                self.self_check_ok = not self.self_check_problems
        except BaseException:
            self.engine.close()
            raise

    def _self_check(self) -> list[str]:
        """What breaks bit-identity on this machine and configuration (empty: nothing): the BLAS
        mode, batch composition and cache state (engine_self_check), the thread count, and -- for a
        checkpoint exported with its calibration -- the bits the exporting machine served
        (calibration.exported_bits: a fleet's servers all answer as the exporter did)."""
        requests = synthetic_requests(self.engine.spec.vocab_size)
        problems = [p for p in [blas_mode_problem()] if p]
        batch_invariant, by_batching = engine_self_check(self._score_ids, requests)
        if not batch_invariant:
            problems.append("results depend on how requests are batched")
        self.self_check_digests = by_batching["alone"]
        expected, why = calibration.exported_bits(self.config)
        if expected is None:
            self.export_check = f"not compared with the export's bits: {why}"
        elif expected == self.self_check_digests:
            self.export_check = "equal to the bits recorded at export"
        else:
            self.export_check = "DIFFERENT from the bits recorded at export"
            problems.append("results differ from the bits the exporting machine served (prism-calibration/manifest.json)")
        threads = torch.get_num_threads()

        def recomputed_at(reqs, count):
            return [[s.probabilities for s in r] for r in self.engine.score(reqs, use_cache=False, threads=count)[0]]

        same, digests = thread_count_check(recomputed_at, requests, threads)
        if not same:
            other = next(t for t in digests if t != threads)
            problems.append(f"results with {threads} threads differ from results with {other}")
        return problems

    def close(self) -> None:
        self.engine.close()

    @staticmethod
    def exact_routes() -> str:
        """The exact-product routes this process chose (timed at the engine's build: a busy machine
        then can pick a slower one, never other bits), e.g. '2+2 576x960 vnni16, ...'; for the log."""
        return describe_chosen_routes() or "none (fp32, or GPU)"

    @staticmethod
    def calibration_sources() -> str:
        """Where the engine's build took its calibration from (shipped with the checkpoint, this
        machine's cache, computed); for the log: a fleet's cold start says why it was cold."""
        return calibration.sources()

    @property
    def available(self) -> bool:
        return self.engine.workers is None or self.engine.workers.failure is None

    def _score_ids(self, requests: list[EncodedRequest]) -> list[list[np.ndarray]]:
        results, _ = self.engine.score(requests)
        return [[s.probabilities for s in r] for r in results]

    def run(self, batch: list[dict[str, np.ndarray]]):
        """One dict of token tensors per request -> per request outputs or a RequestError, + stats."""
        scored, stats = run_valid([or_error(tensors_to_encoded, t) for t in batch], self.engine.score)
        return [s if isinstance(s, RequestError) else _decision_outputs(s) for s in scored], stats


def _decision_outputs(scores) -> dict[str, np.ndarray]:
    return {
        "probabilities": np.concatenate([s.probabilities for s in scores]).reshape(1, -1),
        "scoring_paths": np.array([[s.path.encode() for s in scores]], dtype=np.object_),
    }
