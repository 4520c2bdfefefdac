"""The `decisions` output: one JSON object per task.

    {"task": "severity", "version": 1, "label": "High", "scoring": "candidates",
     "probabilities": {"Low": 0.1, ...}}

Probabilities are the engine's float32 values written as the exact decimal of that float32
(Python's shortest repr of the widened double), so parsing one back and narrowing it to float32
gives the identical bits.
"""
from __future__ import annotations

import json

import numpy as np

from .tasks import Task


def task_info_dict(task: Task) -> dict:
    """What post-processing needs to know of a task."""
    return {"task": task.name, "version": task.version, "options": list(task.options)}


def task_info(task: Task) -> str:
    """`task_info_dict` as JSON, the form it takes between pipeline steps."""
    return json.dumps(task_info_dict(task))


def build_decision(info: dict, probabilities: np.ndarray, path: str,
                   prompt_ids: list[int] | None = None, candidate_ids: list[int] | None = None) -> dict:
    probabilities = np.asarray(probabilities, dtype=np.float32)
    options = info["options"]
    if len(options) != len(probabilities):
        raise ValueError(f"{len(options)} options but {len(probabilities)} probabilities")
    decision = {
        "task": info["task"],
        "version": info["version"],
        "label": options[int(np.argmax(probabilities))],
        "scoring": path,
        "probabilities": {o: float(p) for o, p in zip(options, probabilities)},
    }
    if prompt_ids is not None:
        decision["prompt_ids"] = [int(i) for i in prompt_ids]
        decision["candidate_ids"] = [int(i) for i in candidate_ids]
    return decision
