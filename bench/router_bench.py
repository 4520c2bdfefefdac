"""Router benchmark: consistent hashing on the material vs round-robin, 2 Prism replicas.

    .venv/bin/python bench/router_bench.py [--tickets 11] [--questions 3] [--replicas 2]

The stream: `tickets` support threads, each asked `questions` questions in separate requests,
in a fixed shuffled order, sent by `replicas` concurrent callers through the nginx router. The same stream runs
against a fresh cluster (empty caches) per policy. Reported: prefix-cache reuse summed over the
replicas' metrics (tokens whose K/V came from a cache / prompt tokens), latency, wall time.
"""
from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kernels.cpu.features import machine  # noqa: E402
from prism_backend.processes import free_port  # noqa: E402
from prism_client.client import PrismClient  # noqa: E402
from prism_launcher.cluster import PrismCluster  # noqa: E402
from prism_launcher.router import RouterOptions  # noqa: E402
from prism_launcher.server import ServerOptions  # noqa: E402
from workloads import support_threads, write_result  # noqa: E402

TASKS = ["team", "severity", "reply_time"]


def stream(tickets: int, questions: int) -> list[tuple[str, str]]:
    """Every (ticket, question) once, in a fixed shuffled order: the questions about one ticket
    arrive apart, between other tickets' requests, as they would from separate callers."""
    materials = support_threads(tickets, messages=8)  # ~500 tokens each
    requests = [(m, TASKS[q % len(TASKS)]) for q in range(questions) for m in materials]
    random.Random(0).shuffle(requests)
    return requests


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith(name + "{") or x.startswith(name + " "))


def run(policy: str, replicas: int, requests: list[tuple[str, str]]) -> dict:
    http_port = free_port()
    router = RouterOptions(http_listen=f"127.0.0.1:{http_port}", grpc_listen=f"127.0.0.1:{free_port()}",
                           balance=policy)
    with PrismCluster(replicas, ServerOptions(), router) as cluster:
        warm = PrismClient(f"127.0.0.1:{http_port}")
        for server in cluster.servers:  # one-off warm-up per replica, directly (not through the router)
            PrismClient(f"127.0.0.1:{server.options.http_port}").decide("Warm-up.", ["team"])
        names = ("prism_prefix_cache_tokens_reused_total", "prism_tokens_computed_total")
        before = {n: sum(counter(u, n) for u in cluster.metrics_urls) for n in names}
        work: queue.Queue = queue.Queue()
        for item in requests:
            work.put(item)
        latencies: list[float] = []

        def caller():
            client = PrismClient(f"127.0.0.1:{http_port}")  # one per thread: not thread-safe
            while True:
                try:
                    material, task = work.get_nowait()
                except queue.Empty:
                    return
                start = time.perf_counter()
                client.decide(material, [task])
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        threads = [threading.Thread(target=caller) for _ in range(replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        after = {n: sum(counter(u, n) for u in cluster.metrics_urls) for n in names}
        per_replica = [counter(u, "prism_requests_total") for u in cluster.metrics_urls]
        warm.close()
    reused = after[names[0]] - before[names[0]]
    computed = after[names[1]] - before[names[1]]
    return {"policy": policy, "reuse": reused / (reused + computed), "reused": reused, "computed": computed,
            "median_ms": 1000 * statistics.median(latencies),
            "p90_ms": 1000 * statistics.quantiles(latencies, n=10)[-1], "wall_s": wall,
            "requests_per_replica": [int(x) - 1 for x in per_replica]}  # minus the warm-up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tickets", type=int, default=11)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    requests = stream(args.tickets, args.questions)
    results = [run(policy, args.replicas, requests) for policy in ("consistent-hash", "round-robin")]
    hashed, rr = results
    cpus = sorted(os.sched_getaffinity(0))
    lines = [f"# Router: consistent hashing on the material vs round-robin ({args.replicas} replicas)", "",
             f"{time.strftime('%Y-%m-%d')}, {machine()}", "",
             f"`.venv/bin/python bench/router_bench.py --tickets {args.tickets} --questions {args.questions} "
             f"--replicas {args.replicas}` on CPU(s) {cpus}; each replica gets its share of the cores. "
             f"{len(requests)} requests: {args.tickets} support threads (~500 tokens) x {args.questions} "
             f"questions in a fixed shuffled order, {args.replicas} concurrent callers "
             "through the nginx router, fresh replicas (empty caches) per policy.", "",
             "| policy | prefix-cache reuse | tokens reused | tokens computed | median ms | p90 ms | wall s | "
             "requests per replica |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['reuse']:.1%} | {r['reused']:.0f} | {r['computed']:.0f} | "
                     f"{r['median_ms']:.0f} | {r['p90_ms']:.0f} | {r['wall_s']:.1f} | {r['requests_per_replica']} |")
    lines += ["", f"Consistent hashing / round-robin: tokens computed {hashed['computed'] / rr['computed']:.2f}x, "
              f"median latency {hashed['median_ms'] / rr['median_ms']:.2f}x, wall time "
              f"{hashed['wall_s'] / rr['wall_s']:.2f}x."]
    write_result("router.md", lines)


if __name__ == "__main__":
    main()
