"""`prism determinism-check`: send a fixed set of requests to a running server alone, then
concurrently (so Triton batches them together, in varying orders), and compare the float32 bytes.

Across machines: `--save FILE` records the digests the server answered alone; `--replay FILE`
compares this server's with a recording -- the same checkpoint, configuration and task registry
served on another x86-64 CPU (another vector width or vendor) must give the same bits
(docs/determinism-and-precision.md, "Replay on any x86-64 CPU")."""
from __future__ import annotations

import json
import random
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

from .client import PrismClient
from .determinism import CHECK_REQUESTS, digest


CHECK_RETRIES = 5  # an overloaded answer (503) is retried: the check is about bits, not load


def _digest_of(url: str, protocol: str, request: dict) -> str:
    # one client per call: the HTTP client is not thread-safe. Retried when overloaded: on a busy
    # machine the admission bound refused the check's 8 concurrent requests once (2026-12-05)
    client = PrismClient(url, protocol, retries=CHECK_RETRIES)
    try:
        return digest([d.probability_array() for d in client.decide(request["material"], request["tasks"])])
    finally:
        client.close()


def run_check(url: str, protocol: str = "http", concurrencies=(1, 4, 8), rounds: int = 2, seed: int = 0,
              recorded: list[str] | None = None):
    """Returns (ok, rows, digests): rows of (setting, requests sent, mismatches); digests: one per
    request of CHECK_REQUESTS, answered alone. recorded: digests to replay (another machine's)."""
    reference = [_digest_of(url, protocol, r) for r in CHECK_REQUESTS]
    rng = random.Random(seed)
    rows, ok = [("alone, in order", len(reference), 0)], True
    if recorded is not None:
        mismatches = sum(a != b for a, b in zip(reference, recorded)) + abs(len(recorded) - len(reference))
        ok &= mismatches == 0
        rows.append(("alone, against the recording", len(reference), mismatches))
    for concurrency in concurrencies:
        order = [i for _ in range(rounds) for i in range(len(CHECK_REQUESTS))]
        rng.shuffle(order)
        with ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda i: _digest_of(url, protocol, CHECK_REQUESTS[i]), order))
        mismatches = sum(g != reference[i] for i, g in zip(order, got))
        ok &= mismatches == 0
        rows.append((f"concurrency {concurrency}, shuffled", len(order), mismatches))
    return ok, rows, reference


def save_recording(path: Path, digests: list[str], url: str) -> None:
    Path(path).write_text(json.dumps({"requests": "prism_client.determinism.CHECK_REQUESTS", "server": url,
                                      "digests": digests}, indent=1) + "\n")


def load_recording(path: Path) -> list[str]:
    """The digests of a --save file (or any JSON object with a "digests" list)."""
    digests = json.loads(Path(path).read_text()).get("digests")
    if not isinstance(digests, list) or len(digests) != len(CHECK_REQUESTS):
        raise ValueError(f"{path}: expected a \"digests\" list of {len(CHECK_REQUESTS)} (written by --save)")
    return digests
