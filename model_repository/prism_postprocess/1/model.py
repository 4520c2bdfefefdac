"""Triton adapter for post-processing: probabilities + task metadata -> `decisions` JSON."""
import triton_python_backend_utils as pb_utils

from prism_backend.serving.steps import TOKEN_TENSORS, numpy_inputs, postprocess

INPUTS = ("task_info", "probabilities", "scoring_paths", "return_prompt_ids", *TOKEN_TENSORS)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                decisions = postprocess(numpy_inputs(pb_utils.get_input_tensor_by_name, request, INPUTS))
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("decisions", decisions)]))
            except Exception as exc:
                pb_utils.Logger.log_error(f"prism_postprocess: {exc!r}")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc}")))
        return responses
