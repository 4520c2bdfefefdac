"""Triton adapter for the tokenizer step; the logic lives in prism_backend.serving.steps.TokenizerStep."""
from pathlib import Path

import triton_python_backend_utils as pb_utils

from prism_backend.errors import RequestError
from prism_backend.paths import REGISTRY_FILE
from prism_backend.serving.steps import TokenizerStep, numpy_inputs, triton_engine_config


class TritonPythonModel:
    def initialize(self, args):
        registry = Path(args["model_repository"]) / args["model_version"] / REGISTRY_FILE
        self.step = TokenizerStep(triton_engine_config(args), registry)

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = numpy_inputs(pb_utils.get_input_tensor_by_name, request, ("material", "tasks", "system"))
            try:
                out = self.step.run(inputs["material"], inputs["tasks"], inputs["system"])
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
            except RequestError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
            except Exception as exc:  # a bug: fail this request, keep serving the others
                pb_utils.Logger.log_error(f"prism_tokenizer: {exc!r}")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc}")))
        return responses
