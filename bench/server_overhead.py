"""What tritonserver adds to Prism's engine: the same requests through the server and in-process,
alternately, on workloads (a), (b) and the (c) sweep of bench/side_by_side.py.

    .venv/bin/python bench/server_overhead.py [--repeats 8]

Why alternately: side_by_side.py times the engine and the server in phases minutes apart, and on a
shared machine a phase can run 20-40% slower than the one before it (docs/results.md), which is
larger than the overhead being measured. Here each round sends one batch of new tickets through
the server, then another through the engine in this process (the order swapped every round); the
idle server's processes wait on their queues and take no CPU while the engine runs, so each is
alone on the cores when timed. Both run the int8 default with the prefix cache off (every ticket
is new) and the same thread count. Also reported for (a): where the server's time goes, from
Triton's per-model statistics and Prism's queue-wait metric. Writes bench/results/server_overhead.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request

import torch

from side_by_side import THREADS, alternate, prism_batch_sender, workload_makers
from workloads import write_result

from kernels.cpu.features import machine
from prism_backend.config import EngineConfig
from prism_backend.paths import DEFAULT_MODEL_DIR, REGISTRY_PATH
from prism_backend.processes import free_port
from prism_backend.serving.pipeline import DecisionPipeline
from prism_launcher.server import ServerOptions, TritonServer

FIRST_TICKET = 3 * 10**5  # apart from side_by_side.py's ticket numbers
STEPS = ("prism_tokenizer", "prism_decision", "prism_postprocess")
WAIT, SCORING = "prism_queue_wait_seconds_sum", "prism_execution_seconds_sum"  # prism_decision's metrics


def model_stats(http_port: int) -> dict[str, tuple[int, float]]:
    """Triton's per-model statistics: name -> (successful requests, their total ms)."""
    with urllib.request.urlopen(f"http://localhost:{http_port}/v2/models/stats") as reply:
        stats = json.load(reply)["model_stats"]
    return {m["name"]: (m["inference_stats"]["success"]["count"], m["inference_stats"]["success"]["ns"] / 1e6)
            for m in stats}


def prism_metric_sums(metrics_port: int) -> tuple[float, float]:
    """prism_decision's queue wait and scoring seconds so far, each summed over its series."""
    with urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics") as reply:
        lines = reply.read().decode().splitlines()
    return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
                 for name in (WAIT, SCORING))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=8, help="timed rounds per workload (+1 warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    workloads = workload_makers()
    ticket = iter(range(FIRST_TICKET, FIRST_TICKET + 10**5))
    options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                            max_queue_wait_s=600,
                            extra_parameters={"prefix_cache_bytes": "0", "num_threads": str(THREADS)})
    times: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, float] = {}
    with TritonServer(options):
        engine = DecisionPipeline(EngineConfig(model_dir=DEFAULT_MODEL_DIR, prefix_cache_bytes=0, num_threads=THREADS),
                                  REGISTRY_PATH)
        # a batch's requests sent together through the server, as side_by_side.py sends them
        run = {"server": prism_batch_sender(options.http_port), "engine": engine.decide_many}
        for name, make in workloads.items():
            print(name, flush=True)
            if name.startswith("a"):
                before = model_stats(options.http_port), prism_metric_sums(options.metrics_port)
            times[name] = alternate(run, make, ticket, args.repeats)
            if name.startswith("a"):
                after = model_stats(options.http_port)
                wait, scoring = prism_metric_sums(options.metrics_port)
                count = after["prism"][0] - before[0]["prism"][0]
                for model in ("prism", *STEPS):
                    steps[model] = (after[model][1] - before[0][model][1]) / count
                steps["prism_decision's scheduler: queue wait (gathering)"] = 1000 * (wait - before[1][0]) / count
                steps["prism_decision's scheduler: scoring (a batch of one)"] = 1000 * (scoring - before[1][1]) / count
    write_report(args, times, steps)


def write_report(args, times, steps) -> None:
    lines = [
        "# What tritonserver adds to the engine, measured alternately",
        "",
        f"`.venv/bin/python bench/server_overhead.py --repeats {args.repeats}`; {time.strftime('%Y-%m-%d')}, "
        f"{machine()}, {THREADS} thread(s). The int8 default with the prefix cache off, new tickets every "
        "request; each round one batch through tritonserver (HTTP, PrismClient, the batch's requests sent "
        "together) and one through the engine in-process, alternately; medians of the rounds.",
        "",
        "| workload | engine ms | server ms | server / engine | spread of the rounds' server / engine |",
        "|---|---|---|---|---|",
    ]
    for name, t in times.items():
        engine, server = statistics.median(t["engine"]), statistics.median(t["server"])
        pairs = sorted(s / e for s, e in zip(t["server"], t["engine"]))
        lines.append(f"| {name} | {1000 * engine:.0f} | {1000 * server:.0f} | {server / engine:.3f}x | "
                     f"{pairs[0]:.2f}-{pairs[-1]:.2f}x |")
    lines += [
        "",
        "Where a server request of (a) spends its time (per request, ms; Triton's statistics of each "
        "model: the ensemble `prism` end to end inside the server, then its steps; prism_decision's "
        "step only queues the request, its scoring is the scheduler's):",
        "",
        "| part | ms |",
        "|---|---|",
        *[f"| {part} | {ms:.2f} |" for part, ms in steps.items()],
    ]
    write_result("server_overhead.md", lines)


if __name__ == "__main__":
    main()
