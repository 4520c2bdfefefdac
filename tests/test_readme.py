"""The README's sample output of `prism decide` is what the current code prints for it (the int8
default, in process: the same steps the server runs), to the printed digit, on any x86-64 CPU: the
decisions are the same bits on every CPU kind (tests/test_replay.py)."""
import json

from helpers import REPO_ROOT, SAMPLE_TICKET
from prism_client.cli import format_decisions
from prism_client.client import Decision


def readme_block() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("$ .venv/bin/prism decide --material samples/ticket.txt --task team --task severity\n", 1)[1]
    return block.split("```", 1)[0].rstrip("\n").splitlines()


def test_the_readme_shows_what_prism_decide_prints(int8_pipeline):
    decisions = [Decision.from_json(json.dumps(d)) for d in int8_pipeline.decide(SAMPLE_TICKET, ["team", "severity"])]
    assert format_decisions(decisions).splitlines() == readme_block()
