"""Tensor-parallel worker processes: started by rank 0 (TPWorkers), they run rank r's shard.

    python -m prism_backend.tp_worker RANK WORLD INIT_METHOD CONFIG_JSON

A worker builds its shard (runner.build_model), then loops: receive rank 0's batch of encoded
requests, run the same forest (its half of every layer), repeat; `None` means stop. A worker
dies with its parent (PR_SET_PDEATHSIG) and exits when the group breaks, so no worker outlives
the model. Rank 0 watches its workers: once one has died the engine refuses to score (a clear
error, never a hang) until the model is reloaded.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .config import EngineConfig
from .tp import TPGroup, free_tcp_address, python_executable

STARTUP_TIMEOUT_S = 600


def _config_json(config: EngineConfig) -> str:
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()})


class TPWorkers:
    """Rank 0's side: start ranks 1..N-1, form the group, watch the processes, stop them."""

    def __init__(self, config: EngineConfig):
        from .engine import EngineUnavailable

        self._unavailable = EngineUnavailable
        self.failure: str | None = None
        init = free_tcp_address()
        env = dict(os.environ)
        self.procs = [
            subprocess.Popen([python_executable(), "-m", "prism_backend.tp_worker", str(rank), str(config.tp_size),
                              init, _config_json(config)], env=env)
            for rank in range(1, config.tp_size)
        ]
        self._stopping = False
        try:
            self.group = TPGroup(0, config.tp_size, init, timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        self._watch = threading.Thread(target=self._watchdog, name="prism-tp-watchdog", daemon=True)
        self._watch.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watchdog(self) -> None:
        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and self.failure is None and not self._stopping:
                    self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                                    f"{proc.returncode}; reload the model")
            time.sleep(0.2)

    def broadcast(self, batch) -> None:
        if self.failure is not None:
            raise self._unavailable(self.failure)
        self.group.broadcast(batch)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None:
            try:
                self.group.broadcast(None)
            except Exception:  # a worker is gone: the others exit when the group breaks
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.group.close()

    def _kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    rank, world, init, config_json = int(argv[0]), int(argv[1]), argv[2], argv[3]
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 1
    fields = json.loads(config_json)
    config = EngineConfig(**{**fields, "model_dir": Path(fields["model_dir"])})
    import torch

    from .reproducibility import torch_threads
    from .runner import ForestRunner, build_model

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    group = TPGroup(rank, world, init, timeout_s=STARTUP_TIMEOUT_S)
    try:
        spec, model, _ = build_model(config, group)
        runner = ForestRunner(config, spec, model)
        while True:
            message = group.broadcast()  # (requests, use_cache, threads) from DecisionEngine.score
            if message is None:
                return 0
            batch, use_cache, threads = message
            with torch_threads(threads):
                runner.forward(batch, use_cache)
    finally:
        group.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
