"""Dead-stub recovery of a real `prism serve` (one replica behind the front), any precision.

    .venv/bin/python bench/stub_recovery.py [--precision int8]

Launch to ready; SIGKILL of prism_decision's Python-backend stub (what the OOM killer does); how
soon readiness through the front turns false, what a caller gets meanwhile, how soon it is ready
again, whether the answers are the same bits as before, and how long Ctrl-C then takes.
tests/test_security.py checks the same behaviour (fp32); this prints the figures for the default.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import SAMPLE_TICKET  # noqa: E402
from helpers import Cluster, stop_cleanly  # noqa: E402

from prism_client.client import PrismClient, PrismOverloaded  # noqa: E402
from prism_launcher.server import python_stubs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="int8")
    args = parser.parse_args()
    started = time.monotonic()
    cluster = Cluster(replicas=1, args=("--precision", args.precision))
    print(f"{args.precision} prism serve: ready {time.monotonic() - started:.1f} s after launch", flush=True)

    def answers():
        return [d.probability_array().tobytes() for d in PrismClient(cluster.url).decide(SAMPLE_TICKET, ["team", "severity"])]

    before = answers()
    (server,) = cluster.server_pids(0)
    (stub,) = [s for s in python_stubs(server) if b"prism_decision" in Path(f"/proc/{s}/cmdline").read_bytes()]
    killed = time.monotonic()
    os.kill(stub, signal.SIGKILL)
    while PrismClient(cluster.url).is_ready():
        time.sleep(0.05)
    print(f"readiness false {time.monotonic() - killed:.2f} s after the SIGKILL", flush=True)
    try:
        PrismClient(cluster.url).decide(SAMPLE_TICKET, ["team"])
        print("meanwhile: a request was answered (unexpected)")
    except PrismOverloaded as e:
        print(f"meanwhile: PrismOverloaded ({e.status})")
    while not PrismClient(cluster.url).is_ready():
        time.sleep(0.25)
    print(f"ready again {time.monotonic() - killed:.1f} s after the SIGKILL", flush=True)
    print(f"same bits after recovery: {answers() == before}")
    print(f"clean stop (Ctrl-C): {stop_cleanly(cluster):.1f} s")


if __name__ == "__main__":
    main()
