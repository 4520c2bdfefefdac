"""docs/configuration.md lists every knob: each engine parameter with the default config.py gives it
(written there once), and every PRISM_* environment variable the code reads."""
import dataclasses
import re

from helpers import REPO_ROOT
from prism_backend.config import EngineConfig

DOC = REPO_ROOT / "docs" / "configuration.md"
PACKAGES = ("prism_backend", "prism_client", "prism_launcher", "kernels", "model_repository")


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the markdown table under `heading`."""
    section = DOC.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # past the header
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_every_engine_parameter_is_documented_with_its_default():
    documented = {row[0].strip("`"): row[1].strip("`") for row in table_rows("## Engine parameters")}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(documented) == set(fields)
    for name, field in fields.items():
        if field.default is dataclasses.MISSING or name == "system_prompt":
            continue  # model_dir (required), the prompt's text
        assert documented[name] == str(field.default), (name, documented[name], field.default)


def test_every_environment_variable_the_code_reads_is_documented():
    read = set()
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            read |= set(re.findall(r"[\"'](PRISM_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    documented = {row[0].strip("`") for row in table_rows("## Environment variables")}
    assert read and documented == read, (sorted(read - documented), sorted(documented - read))
