"""The engine's determinism self-check: the same requests must give the same float32 bytes however
they are batched, and at any thread count. Run by the server at startup and by the tests.

The digest of a request's probabilities is the client's (prism_client/determinism.py, a leaf module
of numpy alone), so the engine and `prism determinism-check` compare bits the same way; the fixed
request set that check sends (CHECK_REQUESTS) lives there too.
"""
from __future__ import annotations

import numpy as np

from prism_client.determinism import digest

from ..forest import EncodedRequest


def batchings(n: int) -> list[tuple[str, list[list[int]]]]:
    """Ways to batch requests 0..n-1: alone, all together, reversed, interleaved pairs."""
    everything = list(range(n))
    return [
        ("alone", [[i] for i in everything]),
        ("one batch", [everything]),
        ("reversed", [everything[::-1]]),
        ("pairs", [everything[i : i + 2] for i in range(0, n, 2)]),
        ("odd-even", [everything[1::2] + everything[0::2]]),
    ]


def engine_self_check(score_batch, requests: list) -> tuple[bool, dict[str, list[str]]]:
    """score_batch(list of requests) -> list of per-request probability lists.

    Returns (all identical, digests per batching in request order)."""
    results: dict[str, list[str]] = {}
    for name, groups in batchings(len(requests)):
        digests: list[str | None] = [None] * len(requests)
        for group in groups:
            for i, probs in zip(group, score_batch([requests[i] for i in group])):
                digests[i] = digest(probs)
        results[name] = digests
    reference = results["alone"]
    return all(d == reference for d in results.values()), results


def thread_count_check(score_at, requests: list, configured: int) -> tuple[bool, dict[int, list[str]]]:
    """score_at(requests, threads) -> per-request probability lists, every block recomputed at that
    thread count. Compares the configured count with one thread (with two when it is one), so a
    machine whose kernels reduce in a thread-dependent order says so at start.

    Returns (identical, digests per thread count in request order)."""
    other = 2 if configured == 1 else 1
    results = {threads: [digest(p) for p in score_at(requests, threads)] for threads in (configured, other)}
    return results[configured] == results[other], results


def synthetic_requests(vocab_size: int, seed: int = 0) -> list:
    """Token-id requests for the decision step's startup self-check (it has no tokenizer):
    a shared root, two trunks, one shared by two requests, branches of varied lengths."""
    rng = np.random.RandomState(seed)

    def ids(n):
        return tuple(int(i) for i in rng.randint(0, vocab_size, n))

    root, trunk_a, trunk_b = ids(24), ids(80), ids(47)
    cands = tuple(int(i) for i in rng.choice(vocab_size, 4, replace=False))
    return [
        EncodedRequest(root, trunk_a, (ids(12), ids(9)), (cands, cands[:2])),
        EncodedRequest(root, trunk_b, (ids(15),), (cands[:3],)),
        EncodedRequest(root, trunk_a, (ids(1), ids(20)), (cands, cands[:3])),
    ]
