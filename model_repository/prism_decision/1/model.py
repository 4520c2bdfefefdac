"""Triton adapter for the decision step: one execute() = one forest over the whole batch.

The engine lives in prism_backend (DecisionStep -> DecisionEngine); this file only moves tensors.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from prism_backend.errors import RequestError
from prism_backend.serving import TOKEN_TENSORS, DecisionStep, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.step = DecisionStep(model_parameters(config), Path(args["model_repository"]))
        pb_utils.Logger.log_info(f"prism_decision: ready, {self.step.config}")

    def execute(self, requests):
        batch = []
        for request in requests:
            tensors = {}
            for name in TOKEN_TENSORS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                tensors[name] = None if tensor is None else tensor.as_numpy()
            batch.append(tensors)
        try:
            results, _stats = self.step.run(batch)
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
        return responses
