"""Triton adapter for the decision step: one execute() = one forest over the whole batch.

The engine lives in prism_backend (DecisionStep -> DecisionEngine); this file only moves tensors
and reports metrics. execute() hands its requests to Prism's scheduler (prism_backend/serving/
scheduler.py: urgent first, admission bounded in time, no idle wait) and returns at once; the
scheduler's thread scores batches and answers each request through its response sender.
"""
import json
import time

import triton_python_backend_utils as pb_utils

from prism_backend.errors import EngineUnavailable, RequestError
from prism_backend.serving.decision_step import DecisionStep
from prism_backend.serving.metrics import AdmissionMetrics, EngineMetrics
from prism_backend.serving.scheduler import REASONS, Scheduler
from prism_backend.serving.steps import (SIZE_TENSORS, TOKEN_TENSORS, is_urgent, numpy_inputs, request_size,
                                         triton_engine_config)


def make_family(name, description, kind):
    return pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind.upper()))


def answer(request, response):
    request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def initialize(self, args):
        config = triton_engine_config(args)
        max_batch_size = json.loads(args["model_config"])["max_batch_size"]
        # the engine is built on the scheduler's thread, where it runs (Scheduler.start says why);
        # no request reaches the scheduler before initialize() returns
        self.scheduler = Scheduler(self._run_batch, self._reject, max_batch_size, config.max_queue_wait_s,
                                   max_batch_rows=config.max_batch_rows, gather_s=config.gather_ms / 1000)
        self.step = self.scheduler.start(setup=lambda: DecisionStep(config)).setup_result
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.metrics = EngineMetrics(make_family, labels)
        self.admission = AdmissionMetrics(make_family, labels, REASONS)
        self.metrics.set_self_check(self.step.self_check_ok)
        if self.step.self_check_ok:
            check = "bit-identical across batchings, cache state and thread counts"
        else:
            check = "MISMATCH: " + "; ".join(self.step.self_check_problems)
            pb_utils.Logger.log_error(f"prism_decision: determinism self-check: {check}")
        pb_utils.Logger.log_info(f"prism_decision: ready, {self.step.config}; determinism self-check: {check}, "
                                 f"{self.step.export_check}; "
                                 f"exact-product routes: {self.step.exact_routes()}; "
                                 f"calibration: {self.step.calibration_sources()}")

    def execute(self, requests):
        for request in requests:
            rows, prefix = request_size(numpy_inputs(pb_utils.get_input_tensor_by_name, request, SIZE_TENSORS))
            rejection = self.scheduler.submit(request, is_urgent(request.parameters()), rows, prefix)
            if rejection is not None:
                self._reject(request, rejection)
        return None  # answered later, by the scheduler's thread

    def _reject(self, request, rejection):
        self.admission.rejected["urgent" if rejection.urgent else "bulk", rejection.reason].increment(1)
        answer(request, pb_utils.InferenceResponse(
            error=pb_utils.TritonError(rejection.message, pb_utils.TritonError.UNAVAILABLE)))

    def _run_batch(self, tickets):
        for ticket in tickets:
            self.admission.queue_wait["urgent" if ticket.urgent else "bulk"].observe(ticket.waited)
        requests = [t.item for t in tickets]
        for request, response in zip(requests, self._score(requests)):
            answer(request, response)

    def _score(self, requests):
        """One forest over `requests` -> one response each."""
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
        self.scheduler.stop()  # the running batch ends; what is still queued is answered UNAVAILABLE
        self.step.close()  # tensor-parallel workers exit with the model
        self.metrics.close()
        self.admission.close()
