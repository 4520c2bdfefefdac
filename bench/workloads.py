"""Benchmark workloads, shared by every benchmark so all engines see the same prompts.

(a) shared: one ~600-token ticket, three questions (team, reply_time, severity).
(b) unshared: three unrelated tickets, one question each.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_TICKET = (ROOT / "samples" / "ticket.txt").read_text(encoding="utf-8")
OTHER_TICKETS = json.loads((ROOT / "samples" / "tickets.json").read_text(encoding="utf-8"))

# The sample ticket plus the customer's follow-up: about 600 tokens of material.
SHARED_TICKET = SAMPLE_TICKET + "\n\nFollow-up, 40 minutes later:\n" + OTHER_TICKETS[1].split("\n\n", 1)[1]


def shared_workload() -> list[dict]:
    return [{"material": SHARED_TICKET, "tasks": ["team", "reply_time", "severity"]}]


def unshared_workload() -> list[dict]:
    return [{"material": t, "tasks": [task]} for t, task in zip(OTHER_TICKETS, ["team", "reply_time", "severity"])]


WORKLOADS = {"a: 1 ticket x 3 questions": shared_workload, "b: 3 tickets x 1 question": unshared_workload}
