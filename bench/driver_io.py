"""How the benchmarks run a peer engine's driver script inside that engine's own virtualenv: the
spec goes in as JSON, the driver's OUT dict comes back as JSON (stdlib only: the drivers import it
from their virtualenvs too).

Two ways: `run_driver` hands the driver every call at once and waits for its OUT (a phase: the peer
alone for minutes); `DriverSession` keeps the driver up and hands it one call at a time, each
answered before the next is sent, so a benchmark can time the peer and Prism in turn on the same
cores (side_by_side.alternate), the peer stopped (SIGSTOP) between its calls."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def run_driver(python: Path, script: str, spec: dict) -> dict:
    """`python script IN.json OUT.json` with IN = spec; returns OUT."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        subprocess.run([str(python), script, str(src), str(dst)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(dst.read_text())


class DriverSession:
    """The driver started on `spec` with "stream": true (no "calls"): `call(prompts)` sends one call
    (a list of (prompt ids, candidate ids) submitted together) and returns the driver's answer,
    {"seconds": float, "probabilities": [...]}, the seconds measured inside the driver around the
    engine's work as in a phase; `close()` ends the driver and returns its OUT (rss_bytes,
    startup_seconds). Start-up happens in the constructor, untimed."""

    def __init__(self, python: Path, script: str, spec: dict):
        self._tmp = tempfile.TemporaryDirectory()
        src, self._out = Path(self._tmp.name) / "in.json", Path(self._tmp.name) / "out.json"
        src.write_text(json.dumps({**spec, "stream": True}))
        self.proc = subprocess.Popen([str(python), script, str(src), str(self._out)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._read()  # {"ready": true} once the engine is loaded

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the driver exited (code {self.proc.wait()}) before answering")
        return json.loads(line)

    def call(self, prompts: list[tuple]) -> dict:
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps([{"prompt_ids": p, "candidate_ids": c} for p, c in prompts]) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        # stopped until the next call: after a call vLLM's threads spin on for a while (measured: a
        # core's third for ~2 s), which would run against whatever the benchmark times next
        self._signal(signal.SIGSTOP)
        return answer

    def _signal(self, sig: int) -> None:
        """sig to the driver and every process it started (an engine's workers)."""
        import psutil  # the benchmarks' virtualenv has it; a driver's side never gets here

        for proc in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]:
            proc.send_signal(sig)

    def close(self) -> dict:
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()  # end of calls: the driver writes OUT and exits
        if self.proc.wait(timeout=120):
            raise RuntimeError(f"the driver exited with code {self.proc.returncode}")
        out = json.loads(self._out.read_text())
        self._tmp.cleanup()
        return out

    def __enter__(self) -> DriverSession:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self._tmp.cleanup()


def driver_calls(spec: dict):
    """The driver's side: its calls, each a list of {"prompt_ids", "candidate_ids"}, and where to
    answer each -> (iterator of calls, answer(dict) or None). From spec["calls"] in a phase; from
    stdin, one JSON line each, in a session, whose answers go back one JSON line each on the
    original stdout -- everything else the driver or its engine prints then goes to stderr, so
    call this before importing the engine."""
    if not spec.get("stream"):
        return iter(spec["calls"]), None
    channel = os.fdopen(os.dup(1), "w")  # the session's pipe, kept for the answers alone
    os.dup2(2, 1)  # the engine's own output (C and Python alike) to stderr

    def answer(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    return (json.loads(line) for line in sys.stdin), answer
