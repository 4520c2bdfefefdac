"""Text in, decisions out, in one process: the very step objects the Triton ensemble chains
(steps.py), so the in-process path and the served path are one code path.

    DecisionPipeline(config, registry_path).decide(material, ["team", "severity"])
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import EngineConfig
from ..errors import RequestError, or_error, run_valid
from .decision_step import DecisionStep
from .steps import TokenizerStep, decisions


def _text_tensors(request: dict) -> tuple:
    """A request dict as the tokenizer step's inputs: material (1,), tasks (T,), system (1,) or None."""
    system = request.get("system")
    return (np.array([request.get("material")], dtype=np.object_),
            np.array(list(request.get("tasks", [])), dtype=np.object_),
            None if system is None else np.array([system], dtype=np.object_))


class DecisionPipeline:
    def __init__(self, config: EngineConfig, registry_path: Path, share_weights_with: DecisionPipeline | None = None):
        """share_weights_with: a pipeline whose model this one uses (configs that differ only in
        cache, chunking or limits; see DecisionEngine)."""
        self.tokenizer = TokenizerStep(config, registry_path)
        # The server's startup self-check runs in the Triton model; in process it is tested directly.
        self.decision = DecisionStep(config, self_check=False,
                                     share_weights_with=None if share_weights_with is None else share_weights_with.engine)
        self.frontend, self.engine = self.tokenizer.frontend, self.decision.engine

    def decide_many(self, requests: list[dict], return_prompt_ids: bool = False):
        """requests: [{"material": str, "tasks": [str], "system": str?}] -> per request a list of
        decisions or the RequestError that request raised; the batch's forest statistics."""
        tokens = [or_error(self.tokenizer.run, *_text_tensors(r)) for r in requests]
        scored, stats = run_valid(tokens, self.decision.run)
        flag = np.array([return_prompt_ids])
        results = [s if isinstance(s, RequestError) else decisions({**t, **s, "return_prompt_ids": flag})
                   for t, s in zip(tokens, scored)]
        return results, stats

    def decide(self, material: str, tasks: list[str], system: str | None = None,
               return_prompt_ids: bool = False) -> list[dict]:
        (result,), _ = self.decide_many([{"material": material, "tasks": tasks, "system": system}],
                                        return_prompt_ids)
        if isinstance(result, RequestError):
            raise result
        return result
