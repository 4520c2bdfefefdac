"""The tokenizer and post-processing steps, and the tensors between the three pipeline steps, as
plain numpy-in, numpy-out code that imports neither torch nor the engine: the `prism_tokenizer`
and `prism_postprocess` stubs load only this (tests/test_layout.py checks it). The decision step,
which runs the engine, is decision_step.py.

The Triton `model.py` files only move tensors between `pb_utils` and these, and the in-process
`DecisionPipeline` (pipeline.py) chains the very same objects, so every line of request handling
here runs, and is tested, without a server. Tensor layout between the steps (a leading 1
is the batch dimension of prism_decision):

    root_ids, trunk_ids      (1, L) int32
    branch_ids               (1, sum of branch lengths) int32, branches concatenated in task order
    branch_lengths           (1, T) int32
    candidate_ids            (1, sum of candidate counts) int32
    candidate_counts         (1, T) int32
    task_info                (T,) bytes, JSON per task (decisions.task_info)
    probabilities            (1, sum of candidate counts) float32
    scoring_paths            (1, T) bytes
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import BACKEND_PARAMETERS, EngineConfig
from ..errors import RequestError
from ..forest import EncodedRequest
from ..text.decisions import build_decision, task_info
from ..text.frontend import Frontend

TOKEN_TENSORS = ("root_ids", "trunk_ids", "branch_ids", "branch_lengths", "candidate_ids", "candidate_counts")
SIZE_TENSORS = ("root_ids", "trunk_ids", "branch_ids")  # what request_size reads


def numpy_inputs(get_tensor, request, names) -> dict:
    """{name: numpy array or None} for a Triton request; get_tensor is
    pb_utils.get_input_tensor_by_name (passed in so this module needs no Triton)."""
    out = {}
    for name in names:
        tensor = get_tensor(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


def is_urgent(request_parameters: str) -> bool:
    """Whether a request asks for the urgent lane: the request parameter {"urgent": true} (the JSON
    text of pb_utils.InferenceRequest.parameters(); Triton passes it through the ensemble)."""
    try:
        return json.loads(request_parameters or "{}").get("urgent") is True
    except (ValueError, AttributeError):
        return False


def request_size(tensors: dict) -> tuple[int, np.ndarray]:
    """numpy_inputs' tensors of one request -> (its prompt rows: system prompt, material and
    question ids; its system prompt and material ids, what another request may share): the
    scheduler's row budget (serving/scheduler.py). Missing or odd tensors count as nothing here:
    validation refuses them when the batch runs."""
    def ids(name):
        t = tensors.get(name)
        return np.zeros(0, np.int32) if t is None or t.dtype.kind not in "iu" else t.reshape(-1)

    prefix = np.concatenate([ids("root_ids"), ids("trunk_ids")])
    return prefix.size + ids("branch_ids").size, prefix


def model_parameters(model_config: dict) -> dict[str, str]:
    """The engine's `parameters` of a parsed config.pbtxt, as plain strings."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items() if k not in BACKEND_PARAMETERS}


def triton_engine_config(args: dict) -> EngineConfig:
    """The EngineConfig of a Triton model from the `args` of its initialize(): its config.pbtxt
    parameters, relative paths resolved against the model's own directory."""
    params = model_parameters(json.loads(args["model_config"]))
    return EngineConfig.from_parameters(params, base_dir=Path(args["model_repository"]))


def _split(flat: np.ndarray, lengths: np.ndarray, what: str) -> list[tuple[int, ...]]:
    flat, lengths = flat.reshape(-1), lengths.reshape(-1)
    if (lengths < 0).any() or int(lengths.sum()) != flat.size:
        raise RequestError(f"{what}: lengths sum to {int(lengths.sum())} but {flat.size} ids were given")
    out, start = [], 0
    for n in lengths.tolist():
        out.append(tuple(flat[start : start + n].tolist()))
        start += n
    return out


def encoded_to_tensors(enc: EncodedRequest) -> dict[str, np.ndarray]:
    def row(values):
        return np.asarray(values, dtype=np.int32).reshape(1, -1)

    return {
        "root_ids": row(enc.root),
        "trunk_ids": row(enc.trunk),
        "branch_ids": row([i for b in enc.branches for i in b]),
        "branch_lengths": row([len(b) for b in enc.branches]),
        "candidate_ids": row([i for c in enc.candidates for i in c]),
        "candidate_counts": row([len(c) for c in enc.candidates]),
    }


def tensors_to_encoded(t: dict[str, np.ndarray]) -> EncodedRequest:
    missing = [name for name in TOKEN_TENSORS if t.get(name) is None]
    if missing:
        raise RequestError(f"missing input tensor(s) {missing}")
    if t["branch_lengths"].size != t["candidate_counts"].size:
        raise RequestError(
            f"branch_lengths has {t['branch_lengths'].size} tasks but candidate_counts has "
            f"{t['candidate_counts'].size}"
        )
    return EncodedRequest(
        root=tuple(t["root_ids"].reshape(-1).tolist()),
        trunk=tuple(t["trunk_ids"].reshape(-1).tolist()),
        branches=tuple(_split(t["branch_ids"], t["branch_lengths"], "branch_ids")),
        candidates=tuple(_split(t["candidate_ids"], t["candidate_counts"], "candidate_ids")),
    )


def _single(array, name: str, required: bool = True):
    if array is None:
        if required:
            raise RequestError(f"missing input '{name}'")
        return None
    if array.size != 1:
        raise RequestError(f"input '{name}' must have exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


class TokenizerStep:
    def __init__(self, config: EngineConfig, registry_path: Path):
        self.frontend = Frontend(config, registry_path)

    def run(self, material, tasks, system) -> dict[str, np.ndarray]:
        """material: (1,) bytes; tasks: (T,) bytes; system: (1,) bytes or None."""
        if tasks is None:
            raise RequestError("missing input 'tasks'")
        enc, parsed = self.frontend.encode(
            _single(material, "material"), list(tasks.reshape(-1)), _single(system, "system", required=False)
        )
        out = encoded_to_tensors(enc)
        out["task_info"] = np.array([task_info(t).encode() for t in parsed], dtype=np.object_)
        return out


def decisions(t: dict[str, np.ndarray]) -> list[dict]:
    """One request's step outputs (token tensors, task_info, probabilities, scoring_paths, and the
    optional return_prompt_ids flag) -> its decisions, one dict per task."""
    infos = [json.loads(x) for x in t["task_info"].reshape(-1)]
    probs = t["probabilities"].reshape(-1)
    paths = [p.decode() if isinstance(p, bytes) else str(p) for p in t["scoring_paths"].reshape(-1)]
    counts = t["candidate_counts"].reshape(-1).tolist()
    want_ids = t.get("return_prompt_ids") is not None and bool(t["return_prompt_ids"].reshape(-1)[0])
    enc = tensors_to_encoded(t) if want_ids else None
    out, start = [], 0
    for i, (info, path, n) in enumerate(zip(infos, paths, counts)):
        out.append(build_decision(
            info, probs[start : start + n], path,
            enc.prompt_ids(i) if enc else None, list(enc.candidates[i]) if enc else None,
        ))
        start += n
    return out


def postprocess(t: dict[str, np.ndarray]) -> np.ndarray:
    """Build the `decisions` output, (T,) bytes of JSON."""
    return np.array([json.dumps(d).encode() for d in decisions(t)], dtype=np.object_)
