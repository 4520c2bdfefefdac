"""Priority benchmark: urgent decisions under a saturating bulk load, through a real tritonserver.

    .venv/bin/python bench/priority_bench.py [--bulk-callers 16] [--probes 8] [--batchings 8:1024,8:2048]

Per batching of prism_decision (max_batch_size:max_batch_rows; 0 rows = no row budget): first the
unloaded latency of single-question requests; then
`bulk-callers` callers send two-question requests back to back (more than a batch can hold, so a
backlog queues, up to what prism_decision's scheduler admits within max_queue_wait_s; a refused
bulk request is sent again after 0.2 s), and probe requests, alternately normal and urgent (the
client's `urgent=True`: the scheduler's urgent lane), are timed one at a time. Every request has its
own ticket, so the prefix cache only ever holds the system prompt. Reported: median and p90 probe
latency of the answered probes and their ratio to the unloaded median, and how many probes were
refused (503).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kernels.cpu.features import machine  # noqa: E402
from prism_client.client import PrismClient, PrismOverloaded  # noqa: E402
from prism_backend.processes import free_port  # noqa: E402
from prism_launcher.server import ServerOptions, TritonServer  # noqa: E402
from workloads import eval_tickets, support_threads, write_result  # noqa: E402


def materials() -> itertools.cycle:
    """~250-token support threads (4 shipped eval tickets each), a new one per request."""
    return itertools.cycle(support_threads(len(eval_tickets()) // 4, messages=4))


def run(batching: str, bulk_callers: int, probes: int) -> dict:
    max_batch_size, max_batch_rows = (int(v) for v in batching.split(":"))
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            max_batch_size=max_batch_size, extra_parameters={"max_batch_rows": str(max_batch_rows)})
    source, lock = materials(), threading.Lock()

    def next_material() -> str:
        with lock:
            return next(source)

    with TritonServer(options) as server:
        url = f"127.0.0.1:{server.options.http_port}"
        probe_client = PrismClient(url)

        def probe(urgent: bool) -> float | None:
            start = time.perf_counter()
            try:
                probe_client.decide(next_material(), ["team"], urgent=urgent)
            except PrismOverloaded:
                return None  # refused: the queue could not answer it within the bound
            return time.perf_counter() - start

        probe(False)  # warm-up
        unloaded = [probe(False) for _ in range(probes)]
        stop = threading.Event()
        bulk_done = [0]

        def bulk():
            client = PrismClient(url)
            while not stop.is_set():
                try:
                    client.decide(next_material(), ["team", "severity"])
                    bulk_done[0] += 1
                except PrismOverloaded:
                    time.sleep(0.2)

        callers = [threading.Thread(target=bulk, daemon=True) for _ in range(bulk_callers)]
        for c in callers:
            c.start()
        time.sleep(10)  # let the backlog build
        loaded = {False: [], True: []}
        start = time.perf_counter()
        for i in range(2 * probes):
            urgent = bool(i % 2)
            loaded[urgent].append(probe(urgent))
            time.sleep(0.5)
        bulk_rate = bulk_done[0] / (time.perf_counter() - start + 10)
        stop.set()
        for c in callers:
            c.join(600)
    answered = {u: [t for t in loaded[u] if t is not None] for u in loaded}
    refused = {u: len(loaded[u]) - len(answered[u]) for u in loaded}
    return {"batching": batching, "unloaded": unloaded, "normal": answered[False],
            "urgent": answered[True], "refused": refused, "bulk_rate": bulk_rate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bulk-callers", type=int, default=16)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--batchings", default="8:1024,8:2048",
                        help="comma-separated max_batch_size:max_batch_rows of prism_decision to compare")
    args = parser.parse_args()
    results = [run(batching, args.bulk_callers, args.probes) for batching in args.batchings.split(",")]

    def ms(values, q=None):
        if not values:
            return float("nan")
        if q is None or len(values) < 2:
            return 1000 * statistics.median(values)
        return 1000 * statistics.quantiles(values, n=10)[-1]

    lines = ["# Urgent decisions under a saturating bulk load", "",
             f"`.venv/bin/python bench/priority_bench.py --bulk-callers {args.bulk_callers} --probes {args.probes} "
             f"--batchings {args.batchings}`; {time.strftime('%Y-%m-%d')}, CPU kind {machine()}, "
             f"CPU(s) {sorted(os.sched_getaffinity(0))}; one tritonserver, int8, prefix cache on, max_queue_wait_s "
             f"10 s. Bulk: {args.bulk_callers} callers sending two-question requests (~250-token tickets) back to "
             "back (a refused one again after 0.2 s). Probes: one question, a new ticket each, timed one at a "
             "time, alternately normal and urgent (`urgent=True`: the scheduler's urgent lane).", "",
             "| max_batch_size : max_batch_rows | unloaded median ms | loaded, normal: median / p90 ms (refused) | loaded, urgent: "
             "median / p90 ms (refused) | urgent / unloaded | normal / unloaded | bulk requests/s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        base = ms(r["unloaded"])
        lines.append(f"| {r['batching']} | {base:.0f} | {ms(r['normal']):.0f} / {ms(r['normal'], 90):.0f} "
                     f"({r['refused'][False]}) | {ms(r['urgent']):.0f} / {ms(r['urgent'], 90):.0f} "
                     f"({r['refused'][True]}) | {ms(r['urgent']) / base:.1f}x | "
                     f"{ms(r['normal']) / base:.1f}x | {r['bulk_rate']:.2f} |")
    lines += ["", "An urgent request jumps the queued backlog but not the batch already executing (a CPU batch "
              "is not preempted): its latency is about the rest of that batch plus its own, which holds no bulk "
              "request (prism_backend/serving/scheduler.py); the batch in flight is bounded by max_batch_size "
              "and max_batch_rows. A normal probe waits behind the admitted bulk backlog, which "
              "max_queue_wait_s bounds (or is refused at once when the backlog is full)."]
    write_result("priority.md", lines)


if __name__ == "__main__":
    main()
