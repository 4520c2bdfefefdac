"""What the tests share (import it from here, never from conftest or another test module): the
checkout's paths and sample data, polling, process lookups, metric scrapes, the `prism serve`
harness (Cluster), and skips for what this CPU lacks.

An ISA-specific test skips with a reason that starts with ISA_SKIP, naming the instructions; the
run's closing summary (conftest.py) lists those skips beside the CPU kind, so a green run says what
it covered.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kernels.cpu.features import cpu_kind, has_amx_int8, has_avx2, has_avx512_vnni
from prism_backend.paths import REGISTRY_PATH as REGISTRY, REPO_ROOT  # noqa: F401 (for the tests)
from prism_backend.processes import free_port  # noqa: F401 (for the tests)
from prism_launcher.server import python_stubs, stop_with_parent

SAMPLE_TICKET = (REPO_ROOT / "samples" / "ticket.txt").read_text(encoding="utf-8")
TINY_ARCHS = ("llama3", "llama_tied", "mistral", "qwen2", "qwen3")  # conftest's tiny_model_dir builds each

# Digests of CHECK_REQUESTS' probabilities from the embedded model, int8 default and exact
# (test_replay.py recomputes them; test_cpu_kinds on the forced AVX2 path).
GOLDEN_DECISIONS_PATH = REPO_ROOT / "tests" / "golden_decisions.json"


def run_snippet(code: str, *args, env: dict[str, str] | None = None, unset: tuple[str, ...] = (),
                timeout: float = 600):
    """Run `code` as `python -c code args...` in the checkout (the repository and tests/ importable),
    with this process's environment, `env` over it and `unset` removed -- for what must run in a
    process started otherwise (forced CPU paths, the models' MKL branch); return the JSON its last
    stdout line prints. A non-zero exit fails the test with the snippet's stderr."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), str(REPO_ROOT / "tests")))}
    for name in unset:
        full.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=full, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def decision_digests(pipeline) -> list[str]:
    """One digest per request of the fixed determinism set (prism_client.determinism)."""
    import numpy as np

    from prism_client.determinism import CHECK_REQUESTS, digest

    results, _ = pipeline.decide_many(CHECK_REQUESTS)
    return [digest([np.array(list(d["probabilities"].values()), np.float32) for d in r]) for r in results]


ISA_SKIP = "this CPU lacks"
_NEEDS = {"avx2": (has_avx2, "AVX2 + FMA"), "avx512_vnni": (has_avx512_vnni, "AVX-512 VNNI"),
          "amx_int8": (has_amx_int8, "AMX int8 tiles")}


def isa_reason(isa: str) -> str:
    return f"{ISA_SKIP} {_NEEDS[isa][1]} ({cpu_kind()})"


def needs(isa: str):
    """A mark: skip unless this CPU has `isa` ('avx2', 'avx512_vnni' or 'amx_int8')."""
    has, _ = _NEEDS[isa]
    return pytest.mark.skipif(not has(), reason=isa_reason(isa))


def skip_unless_route_available(route: str) -> None:
    """Skip the calling test where the exact-product route `route` (prism_backend/model/exact_matmul.py)
    cannot run on this CPU at all, naming the instructions it lacks."""
    from kernels.cpu import exact_gemm

    if route in ("vnni8", "vnni16") and not exact_gemm.vnni8_available():
        pytest.skip(isa_reason("avx512_vnni"))
    if route in ("amx8", "amx_digits") and not has_amx_int8():
        pytest.skip(isa_reason("amx_int8"))
    if route in ("int16", "vnni16", "vnni8", "amx8", "amx_digits") and exact_gemm.load() is None:
        pytest.skip(isa_reason("avx2") if not has_avx2() else f"the kernel library: {exact_gemm.why_not()}")


def wait_for(predicate, timeout: float = 60.0) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.3)
    return False


def processes_with(*needles: bytes) -> list[int]:
    """PIDs of the processes whose command line contains every needle. A zombie's command line is
    empty, so exited-but-unreaped processes never match."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if all(needle in cmdline for needle in needles):
            found.append(int(entry.name))
    return found


def scrape(server) -> dict[str, float]:
    """Prometheus text from the server's metrics port -> {name{labels}: value} for prism_* series."""
    return scrape_url(f"http://localhost:{server.options.metrics_port}/metrics")


def scrape_url(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("prism_"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str) -> float:
    """Sum of a metric over its label sets (instances)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


# ---- the `prism serve` harness -------------------------------------------------------------------
TICKETS = [json.loads(line)["material"] for line in open(REPO_ROOT / "evals" / "data" / "tickets.jsonl")]
# ~250-token support threads: long enough to fill whole 128-token prefix-cache blocks
THREADS = ["\n\n".join(TICKETS[4 * i : 4 * i + 4]) for i in range(12)]


class Cluster:
    """`prism serve [--replicas N]` as a user starts it; addresses read from what it prints."""

    def __init__(self, replicas: int = 2, env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.stderr_path = REPO_ROOT / ".run" / f"cluster-cli-{self.http_port}.log"
        self.stderr_path.parent.mkdir(exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism_launcher.cli", "serve", "--replicas", str(replicas),
             "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
             "--metrics-port", str(self.metrics_port), "--ready-timeout", "900", *args],
            stdout=subprocess.PIPE, stderr=open(self.stderr_path, "w"), text=True, cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            preexec_fn=stop_with_parent,  # SIGTERM (a clean stop) if the test process dies
        )
        self.replicas: list[dict] = []
        self.access_log: Path | None = None
        self._read_banner()

    def _read_banner(self) -> None:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter_until_ready(self.process.stdout)), daemon=True)
        reader.start()
        reader.join(1200)
        if not lines or "ready" not in lines[-1]:
            self.process.kill()
            raise RuntimeError(f"cluster did not start: {lines}\n{self.stderr_path.read_text()[-3000:]}")
        for line in lines:
            m = re.search(r"replica (\d+): HTTP (\S+)  gRPC (\S+)  metrics (\S+)", line)
            if m:
                self.replicas.append({"http": m[2], "grpc": m[3], "metrics": m[4]})
        self.access_log = Path(re.search(r"access log (\S+)", lines[-1])[1])
        self.workdir = self.access_log.parent.parent

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def replica_of(self, http_address: str) -> int:
        return [r["http"] for r in self.replicas].index(http_address)

    def server_pids(self, index: int) -> list[int]:
        """tritonserver processes of replica `index` (their command line names its repository)."""
        return processes_with(b"tritonserver", f"{self.workdir}/replica-{index}/model_repository".encode())

    def resident_bytes(self, index: int) -> int:
        """Resident memory of replica `index`: its tritonserver and the stubs it started."""
        total = 0
        for pid in self.server_pids(index):
            for p in [pid, *python_stubs(pid)]:
                try:
                    total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except OSError:
                    pass
        return total

    def shared_memory_regions(self, index: int) -> set[Path]:
        """The /dev/shm regions replica `index`'s server and stubs have mapped (the Python backend's)."""
        regions = set()
        for pid in self.server_pids(index):
            for p in [pid, *python_stubs(pid)]:
                try:
                    maps = Path(f"/proc/{p}/maps").read_text()
                except OSError:
                    continue
                for line in maps.splitlines():
                    fields = line.split(None, 5)  # address perms offset dev inode [path]
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        regions.add(Path(fields[5]))
        return regions

    def kill_replica(self, index: int) -> None:
        """SIGKILL replica `index`'s tritonserver and its Python stubs (their process groups)."""
        for group in {os.getpgid(pid) for pid in self.server_pids(index)}:
            os.killpg(group, signal.SIGKILL)

    def log_since(self, offset: int) -> str:
        """What `prism serve` wrote to stderr after the first `offset` characters."""
        return self.stderr_path.read_text()[offset:]

    def group_processes(self) -> list[int]:
        """Every process still running from this cluster's directory (servers, stubs, nginx)."""
        return processes_with(str(self.workdir).encode())


def stop_cleanly(cluster: Cluster) -> float:
    """Ctrl-C, as a user stops it: exit code 0, nothing left running. Returns the seconds it took."""
    if cluster.process.poll() is not None:
        return 0.0
    started = time.monotonic()
    cluster.process.send_signal(signal.SIGINT)
    try:
        assert cluster.process.wait(120) == 0
    except subprocess.TimeoutExpired:
        cluster.process.kill()  # its servers and router get SIGTERM from the kernel (PR_SET_PDEATHSIG)
        raise
    took = time.monotonic() - started
    assert "router and replicas stopped" in cluster.stderr_path.read_text()
    assert wait_for(lambda: not cluster.group_processes(), 30)
    return took


def exit_timeouts(cluster: Cluster) -> list[str]:
    """Log lines of replicas that waited out tritonserver's --exit-timeout-secs on stop (a dead
    stub does that to Triton 2.51) instead of stopping when their models had unloaded."""
    return [line for log in sorted(cluster.workdir.glob("replica-*/tritonserver.log"))
            for line in log.read_text(errors="replace").splitlines() if "Exit timeout expired" in line]


def iter_until_ready(stream):
    for line in stream:
        yield line.rstrip("\n")
        if line.startswith("prism: ready"):
            return
