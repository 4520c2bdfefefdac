"""Triton adapter for the decision step: one execute() = one forest over the whole batch.

The engine lives in prism_backend (DecisionStep -> DecisionEngine); this file only moves tensors
and reports metrics.
"""
import json
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from prism_backend.engine import EngineUnavailable
from prism_backend.errors import RequestError
from prism_backend.metrics import EngineMetrics
from prism_backend.serving import TOKEN_TENSORS, DecisionStep, model_parameters, numpy_inputs


def make_family(name, description, kind):
    return pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind.upper()))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.step = DecisionStep(model_parameters(config), Path(args["model_repository"]))
        self.metrics = EngineMetrics(make_family, {"model": args["model_name"], "instance": args["model_instance_name"]})
        self.metrics.set_self_check(self.step.self_check_ok)
        if self.step.self_check_ok:
            check = "bit-identical across batchings, cache state and thread counts"
        else:
            check = "MISMATCH: " + "; ".join(self.step.self_check_problems)
            pb_utils.Logger.log_error(f"prism_decision: determinism self-check: {check}")
        pb_utils.Logger.log_info(f"prism_decision: ready, {self.step.config}; determinism self-check: {check}")

    def execute(self, requests):
        start = time.perf_counter()
        batch = [numpy_inputs(pb_utils.get_input_tensor_by_name, r, TOKEN_TENSORS) for r in requests]
        try:
            results, stats = self.step.run(batch)
        except EngineUnavailable as exc:  # a TP worker died: fail fast and say so, never hang
            self.metrics.available.set(0.0)
            pb_utils.Logger.log_error(f"prism_decision: {exc}")
            error = pb_utils.TritonError(f"prism_decision unavailable: {exc}", pb_utils.TritonError.UNAVAILABLE)
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        except Exception as exc:  # a bug: fail this batch with a clear message, keep serving
            pb_utils.Logger.log_error(f"prism_decision: {exc!r}")
            error = pb_utils.TritonError(f"internal error: {exc}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        responses = []
        for result in results:
            if isinstance(result, RequestError):
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(result), pb_utils.TritonError.INVALID_ARG)))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in result.items()]))
        errors = sum(isinstance(r, RequestError) for r in results)
        self.metrics.record_batch(stats, len(requests), errors, time.perf_counter() - start, self.step.engine.cache)
        return responses

    def is_ready(self):
        """Readiness hook of newer Python backends (python_backend PR #430, 2026): not ready once a
        tensor-parallel worker has died. Triton 2.51 does not call it; there the requests fail fast
        with UNAVAILABLE and prism_engine_available drops to 0."""
        return self.step.available

    def finalize(self):
        self.step.close()  # tensor-parallel workers exit with the model
        self.metrics.close()
