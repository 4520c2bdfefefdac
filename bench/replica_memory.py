"""Resident memory of one replica: tritonserver and each Python-backend stub, after new tickets.

    .venv/bin/python bench/replica_memory.py [--precision int8] [--tickets 3] [--side-by-side-load]

Starts the repository as `make serve` would (one tritonserver, the ensemble's three steps), asks
each of `--tickets` new tickets three questions, then reads the resident set (RSS) of the server
and of every stub it started. The target (docs/results.md, "Memory of one replica"): the whole
tree within 1.2 GiB for the embedded model. The tokenizer and post-processing stubs import
neither torch nor the engine (tests/test_layout.py); the decision stub hands back the heap that
building the model freed (tests/test_memory.py).

--side-by-side-load: the heavier load after which bench/side_by_side.py reads its server's memory,
with that server's settings (prefix cache off, its thread count): six batches of each of its
workloads (a), (b) and the (c) sweep, then its closed-loop callers at concurrency 1, 4 and 8 --
without the other engines side_by_side.py runs first. Writes replica_memory_<precision>_load.md.
"""
from __future__ import annotations

import argparse
import datetime

import psutil
from side_by_side import THREADS, prism_batch_sender, throughput, throughput_tickets, workload_makers
from workloads import OTHER_TICKETS, write_result

from kernels.cpu.features import machine
from prism_backend.paths import DEFAULT_MODEL_DIR
from prism_backend.processes import free_port
from prism_client.client import PrismClient
from prism_launcher.server import ServerOptions, TritonServer

TARGET_GIB = 1.2


def role(process: psutil.Process) -> str:
    """What a process of the server tree is: tritonserver or the stub of which model."""
    cmdline = " ".join(process.cmdline())
    for model in ("prism_tokenizer", "prism_decision", "prism_postprocess"):
        if f"{model}/1/model.py" in cmdline:
            return f"{model} stub"
    return "tritonserver" if "tritonserver" in cmdline else cmdline[:60]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--tickets", type=int, default=3)
    parser.add_argument("--side-by-side-load", action="store_true", help="then side_by_side.py's server load")
    args = parser.parse_args()
    load = args.side_by_side_load
    extra = {"prefix_cache_bytes": "0", "num_threads": str(THREADS)} if load else {}
    options = ServerOptions(precision=args.precision, http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_dir=DEFAULT_MODEL_DIR, extra_parameters=extra,
                            max_queue_wait_s=600 if load else None)  # side_by_side.py admits every request
    with TritonServer(options) as server:
        client = PrismClient(f"localhost:{options.http_port}")
        for ticket in OTHER_TICKETS[: args.tickets]:
            client.decide(ticket, ["team", "reply_time", "severity"])
        if load:
            side_by_side_load(options.http_port)
        root = psutil.Process(server.process.pid)
        rows = [(role(p), p.memory_info().rss / 2**20) for p in [root, *root.children(recursive=True)]]
    total = sum(mib for _, mib in rows) / 1024
    lines = [f"# Resident memory of one replica ({args.precision}, {DEFAULT_MODEL_DIR.name})", "",
             f"{datetime.date.today()}, {machine()}; `.venv/bin/python bench/replica_memory.py "
             f"--precision {args.precision} --tickets {args.tickets}{' --side-by-side-load' if load else ''}`"
             + (" (then bench/side_by_side.py's server load, with its settings)" if load else ""), "",
             "| process | resident MiB |", "|---|---|",
             *(f"| {name} | {mib:.0f} |" for name, mib in rows),
             f"| **server tree** | **{total:.2f} GiB** (target ≤ {TARGET_GIB} GiB: "
             f"{'met' if total <= TARGET_GIB else 'missed'}) |"]
    write_result(f"replica_memory_{args.precision}{'_load' if load else ''}.md", lines)


def side_by_side_load(http_port: int) -> None:
    """Six batches of each of side_by_side.py's workloads, then its throughput callers (1, 4, 8)."""
    send = prism_batch_sender(http_port)
    ticket = iter(range(7 * 10**5, 8 * 10**5))  # apart from the other benches' ticket numbers
    for make in workload_makers().values():
        for _ in range(6):
            send(make(next(ticket)))
    for concurrency in (1, 4, 8):
        throughput(send, concurrency, throughput_tickets(8 * 10**5 + 10**4 * concurrency, concurrency))


if __name__ == "__main__":
    main()
