"""Benchmark workloads, shared by every benchmark so all engines see the same prompts, and the
results folder they write to.

(a) shared: one ~600-token ticket, three questions (team, reply_time, severity).
(b) unshared: three unrelated tickets, one question each.
Streams of distinct tickets come from the shipped eval tickets (eval_tickets, support_threads).
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SAMPLE_TICKET = (ROOT / "samples" / "ticket.txt").read_text(encoding="utf-8")
OTHER_TICKETS = json.loads((ROOT / "samples" / "tickets.json").read_text(encoding="utf-8"))

# The sample ticket plus the customer's follow-up: about 600 tokens of material.
SHARED_TICKET = SAMPLE_TICKET + "\n\nFollow-up, 40 minutes later:\n" + OTHER_TICKETS[1].split("\n\n", 1)[1]


def shared_workload() -> list[dict]:
    return [{"material": SHARED_TICKET, "tasks": ["team", "reply_time", "severity"]}]


def unshared_workload() -> list[dict]:
    return [{"material": t, "tasks": [task]} for t, task in zip(OTHER_TICKETS, ["team", "reply_time", "severity"])]


WORKLOADS = {"a: 1 ticket x 3 questions": shared_workload, "b: 3 tickets x 1 question": unshared_workload}


def eval_tickets() -> list[str]:
    """The 1,800 shipped eval tickets (evals/data/tickets.jsonl), in file order."""
    with open(ROOT / "evals" / "data" / "tickets.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["material"] for line in f]


def support_threads(count: int, messages: int) -> list[str]:
    """`count` distinct support threads of `messages` consecutive eval tickets each (~60 tokens per
    ticket), none sharing a ticket."""
    rows = eval_tickets()
    return ["\n\n".join(rows[messages * i : messages * (i + 1)]) for i in range(count)]


def write_result(name: str, lines: list[str]) -> str:
    """bench/results/<name> <- the markdown lines; printed too. Returns the text."""
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(text)
    print(text)
    return text
