"""Task registry and task-spec parsing."""
import json

import pytest

from prism_backend.errors import RequestError
from prism_backend.text.tasks import TaskRegistry

from helpers import REGISTRY


@pytest.fixture
def registry():
    return TaskRegistry.from_file(REGISTRY)


def test_shipped_registry(registry):
    assert registry.names() == ["reply_time", "severity", "team"]
    assert registry.parse("severity", 26).options == ("Low", "Medium", "High", "Critical")
    assert registry.parse("team@1", 26).version == 1


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown task 'nope'"),
    ("team@9", "no version 9"),
    ("team@x", "positive integer"),
    ("", "empty task"),
    ("{bad", "not valid JSON"),
    ("[1, 2]", "unknown task"),
    ('{"options": ["a", "b"]}', "missing 'question'"),
    ('{"question": "q"}', "missing 'options'"),
    ('{"question": "q", "options": ["a"]}', "at least 2 options"),
    ('{"question": "q", "options": ["a", "a "]}', "duplicate options"),
    ('{"question": "q", "options": ["a", 3]}', "option 1 must be a non-empty string"),
    ('{"question": "", "options": ["a", "b"]}', "'question' must be a non-empty string"),
    ('{"question": "q", "options": "ab"}', "must be a list"),
    ('{"question": "q", "options": ["a", "b"], "extra": 1}', "unknown field"),
    (json.dumps({"question": "q", "options": [str(i) for i in range(27)]}), "more than the 26"),
])
def test_bad_specs_name_the_problem(registry, spec, message):
    with pytest.raises(RequestError, match=message):
        registry.parse(spec, 26)


def test_versions_side_by_side(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([
        {"name": "risk", "version": 1, "question": "Risk?", "options": ["low", "high"]},
        {"name": "risk", "version": 2, "question": "Fraud risk?", "options": ["low", "medium", "high"]},
    ]))
    registry = TaskRegistry.from_file(path)
    assert registry.parse("risk", 26).version == 2  # the newest by default
    assert registry.parse("risk@1", 26).options == ("low", "high")


@pytest.mark.parametrize("entry, message", [
    ({"name": "t", "version": 1, "question": "q", "options": ["a", "a"]}, "duplicate"),
    ({"name": "t", "version": 0, "question": "q", "options": ["a", "b"]}, "version"),
    ({"name": "bad name", "version": 1, "question": "q", "options": ["a", "b"]}, "identifier"),
])
def test_bad_registry_fails_naming_the_task(tmp_path, entry, message):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match=message):
        TaskRegistry.from_file(path)
