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
sys.path.insert(0, str(ROOT / "bench"))

from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH as REGISTRY  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402
from workloads import SAMPLE_TICKET, eval_tickets  # noqa: E402

THREADS = 1  # one: on a shared machine a 2-thread OpenMP pool mostly waits for its other thread
BATCH_SIZE = 5
# 18 options: more than max_candidates (16), so this task takes the full-vocabulary path
WIDE = json.dumps({"question": "Which product area is this about?", "options": [f"Area {i}" for i in range(18)]})
INLINE = json.dumps({"question": "Does the customer mention money?", "options": ["Yes", "No", "Unclear"]})
TASK_SETS = [["team", "severity", "reply_time"], ["severity@1", INLINE], ["team", WIDE], ["reply_time"]]


def requests() -> list[dict]:
    """20 requests, 55 decisions: short eval tickets, one material asked twice, the sample ticket
    under a second system prompt."""
    tickets = eval_tickets()[:16]
    out = [{"material": t, "tasks": TASK_SETS[i % len(TASK_SETS)]} for i, t in enumerate(tickets)]
    out.append({"material": tickets[0], "tasks": ["severity@1", "reply_time"]})
    out.append({"material": SAMPLE_TICKET, "tasks": ["team", "severity"]})
    out.append({"material": SAMPLE_TICKET, "tasks": ["team"], "system": "Answer with one letter."})
    out.append({"material": tickets[3], "tasks": [WIDE, INLINE, "team"]})
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
    """Every batch scored twice (with the cache on: cold, then warm) -> sha256, decisions per pass."""
    config = EngineConfig(model_dir=DEFAULT_MODEL_DIR, num_threads=THREADS, **changes)
    pipeline = DecisionPipeline(config, REGISTRY)
    try:
        h = hashlib.sha256()
        batches = [workload[i : i + BATCH_SIZE] for i in range(0, len(workload), BATCH_SIZE)]
        for _ in range(2):
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
        print(f"{name:20s} {decisions} decisions x 2 passes  {digest}  ({time.monotonic() - start:.0f} s)", flush=True)
        total.update(digest.encode())
    print(f"{'all settings':20s} {total.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
