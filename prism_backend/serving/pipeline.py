"""Text in, decisions out, in one process: the same steps the Triton ensemble chains.

    DecisionPipeline(config, registry_path).decide(material, ["team", "severity"])
"""
from __future__ import annotations

from pathlib import Path

from ..config import EngineConfig
from ..engine.engine import DecisionEngine
from ..errors import RequestError
from ..text.decisions import build_decision, task_info_dict
from ..text.frontend import Frontend


class DecisionPipeline:
    def __init__(self, config: EngineConfig, registry_path: Path):
        self.frontend = Frontend(config, registry_path)
        self.engine = DecisionEngine(config)

    def decide_many(self, requests: list[dict], return_prompt_ids: bool = False):
        """requests: [{"material": str, "tasks": [str], "system": str?}] -> per request a list of
        decisions or the RequestError that request raised."""
        encoded, tasks, results = [], [], []
        for r in requests:
            try:
                e, t = self.frontend.encode(r.get("material"), r.get("tasks", []), r.get("system"))
            except RequestError as exc:
                e, t = exc, None
            encoded.append(e)
            tasks.append(t)
        ok = [i for i, e in enumerate(encoded) if not isinstance(e, RequestError)]
        scored, stats = self.engine.score([encoded[i] for i in ok])
        by_index = dict(zip(ok, scored))
        for i, e in enumerate(encoded):
            out = by_index.get(i, e)
            if isinstance(out, RequestError):
                results.append(out)
                continue
            results.append([
                build_decision(
                    task_info_dict(task), s.probabilities, s.path,
                    e.prompt_ids(t) if return_prompt_ids else None,
                    list(e.candidates[t]) if return_prompt_ids else None,
                )
                for t, (task, s) in enumerate(zip(tasks[i], out))
            ])
        return results, stats

    def decide(self, material: str, tasks: list[str], system: str | None = None,
               return_prompt_ids: bool = False) -> list[dict]:
        (result,), _ = self.decide_many([{"material": material, "tasks": tasks, "system": system}],
                                        return_prompt_ids)
        if isinstance(result, RequestError):
            raise result
        return result
