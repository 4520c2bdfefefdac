"""Engine time of any checkout of Prism on workloads (a) and (b), for before/after comparisons
across commits whose modules differ (run it once per tree, alternating).

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before .venv/bin/python bench/tree_time.py /tmp/before [--precision fp32]
    .venv/bin/python bench/tree_time.py .

The tree's own bench/workloads.py and task registry; 2 threads, prefix cache off, median of 5
after a warm-up. Prints only (nothing is written).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("tree", type=Path)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--model-dir", type=Path, default=Path(__file__).resolve().parent.parent / ".models" / "SmolLM2-135M-Instruct")
args = parser.parse_args()
root = args.tree.resolve()
sys.path.insert(0, str(root / "bench"))
sys.path.insert(0, str(root))
from workloads import WORKLOADS  # noqa: E402

import prism_backend  # noqa: E402
from prism_backend.config import EngineConfig  # noqa: E402
from prism_backend.serving.pipeline import DecisionPipeline  # noqa: E402

registry = root / "model_repository" / "prism_tokenizer" / "1" / "tasks.json"
pipeline = DecisionPipeline(EngineConfig(model_dir=args.model_dir, precision=args.precision, prefix_cache_bytes=0,
                                         num_threads=2), registry)
print(f"{prism_backend.__file__} ({args.precision})")
for name, make in WORKLOADS.items():
    requests = make()
    pipeline.decide_many(requests)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        pipeline.decide_many(requests)
        times.append(time.perf_counter() - start)
    print(f"{name}: median {1000 * statistics.median(times):.0f} ms (min {1000 * min(times):.0f}, "
          f"max {1000 * max(times):.0f})", flush=True)
