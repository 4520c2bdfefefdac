"""One sha256 over the float32 probabilities of a fixed set of decisions, in every engine setting
whose bits a refactoring must keep: int8 and fp32, prefix cache off and on (cold, then warm), tensor
parallelism 1 and 2 (in-process: rank 0 here, rank 1 a worker process).

    .venv/bin/python bench/bit_digest.py

Prints one digest per setting and the digest of them all. Equal digests before and after a change
mean not one probability bit moved. Threads are pinned (fp32 GEMMs reduce in a thread-count-
dependent order), so the value is comparable across runs on any machine with the same torch build.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402

THREADS = 1  # one: on a shared machine a 2-thread OpenMP pool mostly waits for its other thread
BATCH_SIZE = 5


def inline(question: str, *options: str) -> str:
    return json.dumps({"question": question, "options": list(options)})


# Short texts: each setting runs the model on ~1,300 rows per pass, so all eight fit in minutes even
# on a busy machine. WIDE has more options than max_candidates (16): the full-vocabulary path.
WIDE = inline("Which product?", *[f"P{i}" for i in range(18)])
SHORT = [inline("Urgent?", "Yes", "No"), inline("Topic?", "Billing", "Bug", "Sales"),
         inline("Mood?", "Calm", "Upset"), inline("Reply by?", "Today", "This week")]
FIFTH = ["severity@1", WIDE, inline("Spam?", "Yes", "No")]
MATERIALS = [
    "I was charged twice for my plan this month.",
    "The app crashes when I upload a photo.",
    "Can we get a quote for 40 more seats?",
    "Checkout fails for all EU customers since 9:00.",
    "Please delete my account and all my data.",
    "Your update broke the export to CSV again!!",
    "How do I change the billing address on invoices?",
    "The dashboard is slow but works.",
]


def requests() -> list[dict]:
    """10 requests, 51 decisions: 5 tasks each on 8 materials (one asked twice, one under a
    second system prompt), registered and inline tasks, candidate and full-vocabulary paths."""
    out = [{"material": m, "tasks": SHORT + [FIFTH[i % len(FIFTH)]]} for i, m in enumerate(MATERIALS)]
    out.append({"material": MATERIALS[0], "tasks": ["team", "reply_time"] + SHORT[:3]})
    out.append({"material": MATERIALS[3], "tasks": ["severity", WIDE] + SHORT, "system": "Answer with one letter."})
    return out


SETTINGS = [  # (name, EngineConfig changes)
    ("int8 tp1 cache-off", dict(precision="int8", prefix_cache_bytes=0)),
    ("int8 tp1 cache-on", dict(precision="int8", prefix_cache_bytes=1 << 28)),
    ("fp32 tp1 cache-off", dict(precision="fp32", prefix_cache_bytes=0)),
    ("fp32 tp1 cache-on", dict(precision="fp32", prefix_cache_bytes=1 << 28)),
    ("int8 tp2 cache-off", dict(precision="int8", prefix_cache_bytes=0, tp_size=2)),
    ("int8 tp2 cache-on", dict(precision="int8", prefix_cache_bytes=1 << 28, tp_size=2)),
    ("fp32 tp2 cache-off", dict(precision="fp32", prefix_cache_bytes=0, tp_size=2)),
    ("fp32 tp2 cache-on", dict(precision="fp32", prefix_cache_bytes=1 << 28, tp_size=2)),
]


def probability_bytes(pipeline: DecisionPipeline, batch: list[dict]) -> bytes:
    results, _ = pipeline.decide_many(batch)
    out = b""
    for result in results:
        if isinstance(result, Exception):
            raise result
        for decision in result:
            out += np.array(list(decision["probabilities"].values()), np.float32).tobytes()
    return out


def setting_digest(changes: dict, workload: list[dict]) -> tuple[str, int]:
    """Every batch scored once, with the cache on twice (cold, then warm) -> sha256, decisions per pass."""
    config = EngineConfig(model_dir=DEFAULT_MODEL_DIR, num_threads=THREADS, **changes)
    pipeline = DecisionPipeline(config, REGISTRY)
    try:
        h = hashlib.sha256()
        batches = [workload[i : i + BATCH_SIZE] for i in range(0, len(workload), BATCH_SIZE)]
        for _ in range(2 if changes.get("prefix_cache_bytes") else 1):
            for batch in batches:
                h.update(probability_bytes(pipeline, batch))
        return h.hexdigest(), sum(len(r["tasks"]) for r in workload)
    finally:
        pipeline.engine.close()


def main() -> int:
    workload = requests()
    total = hashlib.sha256()
    for name, changes in SETTINGS:
        start = time.monotonic()
        digest, decisions = setting_digest(changes, workload)
        print(f"{name:20s} {decisions} decisions  {digest}  ({time.monotonic() - start:.0f} s)", flush=True)
        total.update(digest.encode())
    print(f"{'all settings':20s} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
