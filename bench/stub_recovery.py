"""Dead-stub recovery of what `prism serve` runs (PrismCluster: one replica behind the nginx front,
watched as `prism serve` watches it), any precision.

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
import threading
import time
from pathlib import Path

from workloads import SAMPLE_TICKET

from prism_backend.processes import free_port
from prism_client.client import PrismClient, PrismOverloaded
from prism_launcher.cli import WATCH_INTERVAL_S
from prism_launcher.cluster import PrismCluster
from prism_launcher.router import RouterOptions
from prism_launcher.server import ServerOptions, python_stubs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="int8")
    args = parser.parse_args()
    http = f"127.0.0.1:{free_port()}"
    router = RouterOptions(http_listen=http, grpc_listen=f"127.0.0.1:{free_port()}",
                           metrics_listen=f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    cluster = PrismCluster(1, ServerOptions(precision=args.precision), router).start()
    watching = threading.Event()

    def watch() -> None:  # `prism serve`'s loop: heal every WATCH_INTERVAL_S (a dead stub: restart its replica)
        while not watching.wait(WATCH_INTERVAL_S):
            cluster.heal()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        print(f"{args.precision} prism serve: ready {time.monotonic() - started:.1f} s after launch", flush=True)

        def answers():
            return [d.probability_array().tobytes() for d in PrismClient(http).decide(SAMPLE_TICKET, ["team", "severity"])]

        before = answers()
        (server,) = cluster.servers
        (stub,) = [s for s in python_stubs(server.process.pid) if b"prism_decision" in Path(f"/proc/{s}/cmdline").read_bytes()]
        killed = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        while PrismClient(http).is_ready():
            time.sleep(0.05)
        print(f"readiness false {time.monotonic() - killed:.2f} s after the SIGKILL", flush=True)
        try:
            PrismClient(http).decide(SAMPLE_TICKET, ["team"])
            print("meanwhile: a request was answered (unexpected)")
        except PrismOverloaded as e:
            print(f"meanwhile: PrismOverloaded ({e.status})")
        while not PrismClient(http).is_ready():
            time.sleep(0.25)
        print(f"ready again {time.monotonic() - killed:.1f} s after the SIGKILL", flush=True)
        print(f"same bits after recovery: {answers() == before}")
    finally:
        watching.set()
        watcher.join()
        stopping = time.monotonic()
        cluster.stop()
        print(f"clean stop (what Ctrl-C runs): {time.monotonic() - stopping:.1f} s")


if __name__ == "__main__":
    main()
