"""Raw request fields -> tasks + segment token ids: the work of the tokenizer step.

Behind `serving.steps.TokenizerStep`, which the `prism_tokenizer` Triton model and
`DecisionPipeline` both call, so the prompt is defined in exactly one place (prompt.py).
"""
from __future__ import annotations

from pathlib import Path

from ..config import EngineConfig
from ..errors import RequestError
from ..forest import EncodedRequest
from ..model.spec import max_context
from .prompt import PromptBuilder
from .tasks import Task, TaskRegistry
from .tokenizer import load_tokenizer


def decode_text(value, field: str) -> str:
    """A BYTES element as text; invalid UTF-8 is the caller's error."""
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"'{field}' is not valid UTF-8 (byte {exc.start})") from None


def _raw(value) -> bytes:
    return bytes(value) if isinstance(value, (bytes, bytearray)) else str(value).encode("utf-8")


class Frontend:
    def __init__(self, config: EngineConfig, registry_path: Path):
        self.config = config
        self.registry = TaskRegistry.from_file(registry_path, config.max_options)
        self.prompts = PromptBuilder(load_tokenizer(config.model_dir), max_context(config.model_dir), config.max_options)

    def parse_tasks(self, specs: list) -> list[Task]:
        if not specs:
            raise RequestError("no tasks: give at least one element in 'tasks'")
        return [self.registry.parse(decode_text(s, "tasks"), self.config.max_options) for s in specs]

    def check_sizes(self, material, task_specs: list, system) -> None:
        """Refuse oversized text before any tokenizing: the work must not grow with what a caller sends."""
        if len(task_specs) > self.config.max_tasks_per_request:
            raise RequestError(
                f"{len(task_specs)} tasks in one request; the limit is {self.config.max_tasks_per_request}"
            )
        limit = self.config.max_material_bytes
        for field, value in (("material", material), ("system", system),
                             ("tasks", b"".join(_raw(s) for s in task_specs))):
            if value is not None and len(_raw(value)) > limit:
                raise RequestError(f"'{field}' is {len(_raw(value))} bytes; the limit is {limit} bytes "
                                   f"(parameter max_material_bytes)")

    def encode(self, material, task_specs: list, system=None) -> tuple[EncodedRequest, list[Task]]:
        self.check_sizes(material, task_specs, system)
        material = decode_text(material, "material")
        system = self.config.system_prompt if system is None else decode_text(system, "system")
        if "\x00" in material:
            raise RequestError("'material' contains NUL bytes; binary data cannot be a document")
        tasks = self.parse_tasks(task_specs)
        return self.prompts.encode(system, material, tasks), tasks
