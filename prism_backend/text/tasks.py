"""Decision tasks: the registry of named, versioned tasks, and parsing of task specs.

A task is a question with lettered options. A request names a task as `"severity"` (the newest
registered version), `"severity@2"` (pinned), or carries it inline as JSON
`{"question": "...", "options": ["...", ...]}`.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from ..errors import RequestError

LETTERS = string.ascii_uppercase


@dataclass(frozen=True)
class Task:
    name: str  # registered name, or "inline"
    version: int | None  # None for inline tasks
    question: str
    options: tuple[str, ...]

    @property
    def letters(self) -> tuple[str, ...]:
        return tuple(LETTERS[: len(self.options)])


def validate_task_fields(question: object, options: object, max_options: int, where: str) -> Task:
    """Check the question and options of a task; raises RequestError naming `where`."""
    if not isinstance(question, str) or not question.strip():
        raise RequestError(f"{where}: 'question' must be a non-empty string")
    if not isinstance(options, list):
        raise RequestError(f"{where}: 'options' must be a list of strings")
    if len(options) < 2:
        raise RequestError(f"{where}: needs at least 2 options, got {len(options)}")
    if len(options) > max_options:
        raise RequestError(
            f"{where}: has {len(options)} options, more than the {max_options} that can be lettered"
        )
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option.strip():
            raise RequestError(f"{where}: option {i} must be a non-empty string, got {option!r}")
    stripped = [o.strip() for o in options]
    duplicates = sorted({o for o in stripped if stripped.count(o) > 1})
    if duplicates:
        raise RequestError(f"{where}: duplicate options {duplicates}")
    return Task("inline", None, question.strip(), tuple(stripped))


class TaskRegistry:
    """Named tasks with versions, loaded from a JSON file shipped inside the model version dir."""

    def __init__(self, tasks: list[Task]):
        self._by_name: dict[str, dict[int, Task]] = {}
        for task in tasks:
            versions = self._by_name.setdefault(task.name, {})
            if task.version in versions:
                raise ValueError(f"task registry: {task.name}@{task.version} is defined twice")
            versions[task.version] = task

    @classmethod
    def from_file(cls, path: Path, max_options: int = len(LETTERS)) -> "TaskRegistry":
        try:
            entries = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"task registry {path}: cannot read: {exc}") from exc
        if not isinstance(entries, list):
            raise ValueError(f"task registry {path}: must be a JSON list of task objects")
        tasks = []
        for i, entry in enumerate(entries):
            name, version = entry.get("name"), entry.get("version")
            where = f"task registry {path}: task {name!r} (entry {i})"
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"{where}: 'name' must be an identifier")
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise ValueError(f"{where}: 'version' must be a positive integer")
            try:
                fields = validate_task_fields(entry.get("question"), entry.get("options"), max_options, where)
            except RequestError as exc:
                raise ValueError(str(exc)) from None
            tasks.append(Task(name, version, fields.question, fields.options))
        return cls(tasks)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, name: str, version: int | None = None) -> Task:
        versions = self._by_name.get(name)
        if versions is None:
            raise RequestError(f"unknown task {name!r}; registered tasks: {self.names()}")
        if version is None:
            return versions[max(versions)]
        if version not in versions:
            raise RequestError(
                f"task {name!r} has no version {version}; available versions: {sorted(versions)}"
            )
        return versions[version]

    def parse(self, spec: str, max_options: int) -> Task:
        """Turn one element of the `tasks` input into a Task."""
        spec = spec.strip()
        if not spec:
            raise RequestError("empty task: give a registered task name or an inline JSON task")
        if spec.startswith("{"):
            try:
                obj = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise RequestError(f"inline task is not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise RequestError("inline task must be a JSON object")
            unknown = sorted(set(obj) - {"question", "options"})
            if unknown:
                raise RequestError(f"inline task has unknown field(s) {unknown}; allowed: question, options")
            if "question" not in obj:
                raise RequestError("inline task is missing 'question'")
            if "options" not in obj:
                raise RequestError("inline task is missing 'options'")
            return validate_task_fields(obj["question"], obj["options"], max_options, "inline task")
        name, _, version_text = spec.partition("@")
        version = None
        if version_text:
            if not version_text.isdigit():
                raise RequestError(f"task {spec!r}: version after '@' must be a positive integer")
            version = int(version_text)
        return self.get(name, version)
