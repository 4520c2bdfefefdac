"""What "the same bits" means, on both sides of the wire: the digest of a request's probabilities,
and the fixed set of requests the determinism checks send.

`prism determinism-check` (determinism_check.py) digests what a running server answers; the
engine's startup self-check (prism_backend/serving/determinism.py) digests what it computes, with
this same function. A leaf module: numpy and the standard library only, so the engine may import
it (an exported repository carries prism_client for it) and the client stays free of the engine.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

_INLINE = json.dumps({"question": "Does the customer mention money?", "options": ["Yes", "No", "Unclear"]})

# A fixed set: shared tickets, unrelated tickets, registered and inline tasks.
CHECK_REQUESTS = [
    {"material": "Checkout fails with error PX-502 for all EU customers since this morning. "
                 "We lose 4,000 EUR per hour.", "tasks": ["team", "severity", "reply_time"]},
    {"material": "I was charged twice for my annual plan, please refund one charge.", "tasks": ["team", _INLINE]},
    {"material": "Checkout fails with error PX-502 for all EU customers since this morning. "
                 "We lose 4,000 EUR per hour.", "tasks": ["severity"]},
    {"material": "Could you send a quote for 250 more seats?", "tasks": ["reply_time", "team"]},
    {"material": "The app crashes when I upload a photo on Android 14.", "tasks": ["severity", _INLINE]},
]


def digest(probabilities: list[np.ndarray]) -> str:
    """sha256 over the float32 bytes of one request's probabilities, task by task."""
    h = hashlib.sha256()
    for p in probabilities:
        h.update(np.asarray(p, dtype=np.float32).tobytes())
        h.update(b"|")
    return h.hexdigest()
