"""Bounded latency, through `prism serve`'s stack (nginx front + replicas, PrismCluster): overload and
bursts after quiet.

    .venv/bin/python bench/latency_bench.py [--seconds 60] [--callers 64] [--bursts 8]

overload  `callers` callers send one-question requests about new tickets back to back for `seconds`,
          against the default (1 replica, 1 instance), `--instances 2` and `--replicas 2`. Every
          answer must be 200 or 503 with a message; reported: the admitted requests' p50 / p99
          latency (bound: max_queue_wait_s, 10 s), the 503s' p50, the peak resident memory of the
          replicas' process trees, and whether a fixed request gives the same bits before and after.
bursts    `bursts` times: 2 s of quiet, then 3 concurrent one-question requests about new tickets.
          Idle time of a burst = its wall time - the time prism_decision spent scoring in it (the
          prism_execution_seconds sum, from the metrics); the default and the 8-bit rung.
Writes bench/results/latency.md.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kernels.cpu.features import machine  # noqa: E402
from prism_backend.processes import free_port  # noqa: E402
from prism_client.client import PrismClient, PrismOverloaded  # noqa: E402
from prism_launcher.cluster import PrismCluster  # noqa: E402
from prism_launcher.router import RouterOptions  # noqa: E402
from prism_launcher.server import ServerOptions  # noqa: E402
from workloads import SAMPLE_TICKET, eval_tickets, support_threads, write_result  # noqa: E402


def new_tickets():
    """An endless supply of tickets none of which repeats within a run (~250 tokens each)."""
    threads = support_threads(len(eval_tickets()) // 4, messages=4)
    for n in itertools.count():
        yield threads[n % len(threads)] + f"\n(request {n})"


def group_rss(pid: int) -> int:
    """Resident bytes of process `pid`'s process group (a tritonserver and its stubs)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pid:  # pgid
                total += int((entry / "statm").read_text().split()[1]) * 4096
        except (OSError, IndexError, ValueError):
            continue
    return total


def execution_seconds(cluster: PrismCluster) -> float:
    total = 0.0
    for url in cluster.metrics_urls:
        with urllib.request.urlopen(url) as r:
            total += sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                         if line.startswith("prism_execution_seconds_sum"))
    return total


def started(replicas: int, instances: int, precision: str = "int8") -> tuple[PrismCluster, str]:
    http = f"127.0.0.1:{free_port()}"
    router = RouterOptions(http_listen=http, grpc_listen=f"127.0.0.1:{free_port()}")
    options = ServerOptions(instances=instances, precision=precision)
    cluster = PrismCluster(replicas, options, router).start()
    return cluster, http


def fixed_bits(url: str) -> bytes:
    with PrismClient(url) as client:
        return b"".join(d.probability_array().tobytes() for d in client.decide(SAMPLE_TICKET, ["team", "severity"]))


def overload(replicas: int, instances: int, callers: int, seconds: float, tickets) -> dict:
    cluster, url = started(replicas, instances)
    try:
        before = fixed_bits(url)
        lock, results, bad, peak = threading.Lock(), [], [], [0]
        deadline = time.monotonic() + seconds

        def caller():
            with PrismClient(url) as client:
                while time.monotonic() < deadline:
                    with lock:
                        material = next(tickets)
                    start = time.monotonic()
                    try:
                        client.decide(material, ["team"])
                        outcome = "200"
                    except PrismOverloaded as refused:
                        outcome = "503" if refused.message else "503 without a message"
                    except Exception as exc:  # anything else is a failure of the bound
                        outcome = f"other: {exc!r}"[:200]
                    with lock:
                        results.append((outcome, time.monotonic() - start))
                        if outcome not in ("200", "503"):
                            bad.append(outcome)

        def watch():
            while time.monotonic() < deadline + 30:
                peak[0] = max(peak[0], sum(group_rss(s.process.pid) for s in cluster.servers))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        threads = [threading.Thread(target=caller) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        drained = time.monotonic() - deadline
        after = fixed_bits(url)
        admitted = sorted(t for o, t in results if o == "200")
        refused = sorted(t for o, t in results if o == "503")
        return {"admitted": len(admitted), "p50": statistics.median(admitted) if admitted else float("nan"),
                "p99": admitted[min(len(admitted) - 1, int(0.99 * len(admitted)))] if admitted else float("nan"),
                "refused": len(refused), "refused_p50": statistics.median(refused) if refused else float("nan"),
                "other": len(bad), "peak_gib": peak[0] / 2**30, "same_bits": before == after, "drained": drained}
    finally:
        cluster.stop()


def bursts(count: int, precision: str, tickets) -> list[float]:
    cluster, url = started(1, 1, precision)
    try:
        fixed_bits(url)  # warm-up
        idle = []
        for _ in range(count):
            time.sleep(2.0)
            materials = [next(tickets) for _ in range(3)]
            before = execution_seconds(cluster)
            start = time.monotonic()
            threads = [threading.Thread(target=lambda m=m: PrismClient(url).decide(m, ["team"])) for m in materials]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - start
            time.sleep(0.2)  # metrics are written just after the responses
            idle.append(wall - (execution_seconds(cluster) - before))
        return idle
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=8)
    parser.add_argument("--only", choices=("overload", "bursts"), default=None)
    args = parser.parse_args()
    tickets = new_tickets()
    lines = ["# Bounded latency: overload and bursts after quiet", "",
             f"`.venv/bin/python bench/latency_bench.py --seconds {args.seconds:g} --callers {args.callers} "
             f"--bursts {args.bursts}`; {time.strftime('%Y-%m-%d')}, CPU kind {machine()}, "
             f"{len(__import__('os').sched_getaffinity(0))} cores; `prism serve`'s stack (nginx front + replicas), "
             "int8 default, max_queue_wait_s 10 s.", ""]
    if args.only in (None, "overload"):
        lines += [f"## Overload: {args.callers} callers, one question each about a new ticket, back to back, "
                  f"{args.seconds:g} s", "",
                  "| setup | admitted | admitted p50 / p99 s | 503 | 503 p50 s | other answers | peak memory GiB | "
                  "same bits after | drained after s |", "|---|---|---|---|---|---|---|---|---|"]
        for name, replicas, instances in (("default", 1, 1), ("--instances 2", 1, 2), ("--replicas 2", 2, 1)):
            r = overload(replicas, instances, args.callers, args.seconds, tickets)
            lines.append(f"| {name} | {r['admitted']} | {r['p50']:.2f} / {r['p99']:.2f} | {r['refused']} | "
                         f"{r['refused_p50']:.3f} | {r['other']} | {r['peak_gib']:.2f} | {r['same_bits']} | "
                         f"{r['drained']:.1f} |")
            print(lines[-1], flush=True)
        lines.append("")
    if args.only in (None, "bursts"):
        lines += [f"## Bursts after quiet: {args.bursts} x (2 s quiet, 3 concurrent one-question requests, new "
                  "tickets)", "", "idle = wall time of the burst - prism_decision's scoring time in it.", "",
                  "| precision | idle per burst, ms | max ms |", "|---|---|---|"]
        for name, precision in (("int8 default", "int8"), ("exact", "exact")):
            idle = bursts(args.bursts, precision, tickets)
            lines.append(f"| {name} | {' / '.join(f'{1000 * i:.0f}' for i in idle)} | {1000 * max(idle):.0f} |")
            print(lines[-1], flush=True)
    write_result("latency.md", lines)


if __name__ == "__main__":
    main()
