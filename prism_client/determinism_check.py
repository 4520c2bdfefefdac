"""`prism determinism-check`: send a fixed set of requests to a running server alone, then
concurrently (so Triton batches them together, in varying orders), and compare the float32 bytes."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from .client import PrismClient
from .determinism import CHECK_REQUESTS, digest


def _digest_of(url: str, protocol: str, request: dict) -> str:
    client = PrismClient(url, protocol)  # one per call: the HTTP client is not thread-safe
    try:
        return digest([d.probability_array() for d in client.decide(request["material"], request["tasks"])])
    finally:
        client.close()


def run_check(url: str, protocol: str = "http", concurrencies=(1, 4, 8), rounds: int = 2, seed: int = 0):
    """Returns (ok, rows): rows of (setting, requests sent, mismatches)."""
    reference = [_digest_of(url, protocol, r) for r in CHECK_REQUESTS]
    rng = random.Random(seed)
    rows, ok = [("alone, in order", len(reference), 0)], True
    for concurrency in concurrencies:
        order = [i for _ in range(rounds) for i in range(len(CHECK_REQUESTS))]
        rng.shuffle(order)
        with ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda i: _digest_of(url, protocol, CHECK_REQUESTS[i]), order))
        mismatches = sum(g != reference[i] for i, g in zip(order, got))
        ok &= mismatches == 0
        rows.append((f"concurrency {concurrency}, shuffled", len(order), mismatches))
    return ok, rows
