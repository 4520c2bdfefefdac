"""Run Triton's perf_analyzer (from .venv, shipped by tritonclient) against the `prism` ensemble.

    .venv/bin/python bench/run_perf.py [--url localhost:8000] [--precision int8]

Without --url it starts its own server on free ports. Workloads (perf_analyzer input-data JSON in
perf_analyzer_configs/, where Triton users look for it, written from bench/workloads.py so every
benchmark uses the same prompts):
  shared.json    one ~600-token ticket, 3 tasks per request (team, reply_time, severity)
  unshared.json  three unrelated tickets, 1 task per request
Concurrency 1, 2, 4 and 8; the table goes to bench/results/perf_analyzer.md.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from workloads import shared_workload, unshared_workload, write_result

from kernels.cpu.features import machine
from prism_backend.paths import REPO_ROOT
from prism_backend.processes import free_port
from prism_launcher.server import ServerOptions, TritonServer, _package_dir

CONFIGS = REPO_ROOT / "perf_analyzer_configs"  # the input-data files, one per workload

WORKLOADS = {"shared": shared_workload, "unshared": unshared_workload}


def write_input_data() -> dict[str, Path]:
    paths = {}
    for name, make in WORKLOADS.items():
        data = [{"material": [r["material"]], "tasks": {"content": r["tasks"], "shape": [len(r["tasks"])]}}
                for r in make()]
        path = CONFIGS / f"{name}.json"
        path.write_text(json.dumps({"data": data}, indent=1) + "\n")
        paths[name] = path
    return paths


def perf_env() -> dict[str, str]:
    """perf_analyzer links libcudart (from nvidia-cuda-runtime-cu12) even without a GPU."""
    env = dict(os.environ)
    cudart = _package_dir("nvidia.cuda_runtime") / "lib"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(cudart), env.get("LD_LIBRARY_PATH", "")] if p)
    return env


def window_requests(concurrency: int) -> int:
    """Requests per measurement window at this concurrency."""
    return max(8, 3 * concurrency)


def run_perf(url: str, data: Path, concurrency: int, request_count: int | None = None) -> dict[str, float]:
    """One perf_analyzer run. By default it measures in windows until two agree within 50%
    (up to 4 windows: a benchmark's number); with `request_count` it sends exactly that many
    requests and reports them, with no stability criterion -- what a check that the path works
    needs, since on a shared 2-core machine windows of a few requests can disagree by more."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    csv_path = CONFIGS / f".perf-{data.stem}-{concurrency}.csv"
    cmd = [str(binary), "-m", "prism", "-u", url, "-i", "http", "--input-data", str(data),
           "--concurrency-range", str(concurrency), "-f", str(csv_path)]
    if request_count is None:
        cmd += ["--measurement-mode", "count_windows", "--measurement-request-count", str(window_requests(concurrency)),
                "--stability-percentage", "50", "--max-trials", "4"]
    else:
        cmd += ["--request-count", str(request_count)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=perf_env(), timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed:\n{done.stdout}\n{done.stderr}")
    row = next(csv.DictReader(io.StringIO(csv_path.read_text())))
    csv_path.unlink()
    return {"throughput": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1000, "p99_ms": float(row["p99 latency"]) / 1000}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="a running server's HTTP address; default: start one")
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefix-cache", action="store_true",
                        help="keep the server's prefix cache on; off by default, since perf_analyzer repeats the "
                             "same requests and would otherwise measure cache hits, not computation")
    args = parser.parse_args()
    paths = write_input_data()
    server = None
    if args.url is None:
        server = TritonServer(ServerOptions(precision=args.precision, instances=args.instances,
                                            http_port=free_port(), grpc_port=free_port(),
                                            metrics_port=free_port(),
                                            extra_parameters={} if args.prefix_cache else {"prefix_cache_bytes": "0"},
                                            )).start()
        args.url = f"localhost:{server.options.http_port}"
    cache = "prefix cache on" if args.prefix_cache else "prefix cache off"
    lines = [f"perf_analyzer against `prism` ({args.precision}, {args.instances} instance(s), {cache}); "
             f"one inference = one request (one ticket, all its tasks); {time.strftime('%Y-%m-%d')}, {machine()}", "",
             "| workload | concurrency | requests/s | decisions/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    try:
        for name, path in paths.items():
            tasks_per_request = len(WORKLOADS[name]()[0]["tasks"])
            for c in args.concurrency:
                try:
                    r, note = run_perf(args.url, path, c), ""
                except RuntimeError as error:  # windows never agreed within 50% (a noisy shared machine)
                    if "stable measurement" not in str(error):
                        raise
                    count = 4 * window_requests(c)  # as many as the 4 windows would have sent
                    r, note = run_perf(args.url, path, c, request_count=count), f" (unstable; {count} requests)"
                lines.append(f"| {name} | {c}{note} | {r['throughput']:.2f} | {r['throughput'] * tasks_per_request:.2f} | "
                             f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} |")
                print(lines[-1], flush=True)
    finally:
        if server:
            server.stop()
    write_result("perf_analyzer.md", lines)


if __name__ == "__main__":
    main()
