"""Prism servers behind the nginx front: what `prism serve` runs, one replica or `--replicas N`.

The local form of the production layout (docs/scale-out.md): N independent tritonservers, each
with its own prefix cache, and the front (router.py) that sends requests about the same material
to the same replica and lets only the allowed APIs through. Replicas listen on free loopback ports;
only the front's ports are public. `heal()` restarts a replica whose server exited or whose
Python-backend stub died (docs/security.md, "Self-healing").
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from prism_backend.config import ConfigError
from prism_backend.processes import free_port

from .router import NginxRouter, Replica, RouterOptions
from .server import LOOPBACK, READY_TIMEOUT_S, RUN_DIR, ServerOptions, TritonServer


class PrismCluster:
    def __init__(self, replicas: int, server: ServerOptions, router: RouterOptions, workdir: Path | None = None):
        if replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {replicas}")
        router.validate()
        RUN_DIR.mkdir(exist_ok=True)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="cluster-", dir=RUN_DIR))
        self.servers = [
            TritonServer(
                dataclasses.replace(server, http_port=free_port(), grpc_port=free_port(),
                                    metrics_port=free_port(), servers_on_machine=replicas),
                workdir=self.workdir / f"replica-{i}",
            )
            for i in range(replicas)
        ]
        addresses = [Replica(f"{LOOPBACK}:{s.options.http_port}", f"{LOOPBACK}:{s.options.grpc_port}",
                             f"{LOOPBACK}:{s.options.metrics_port}") for s in self.servers]
        self.router = NginxRouter(addresses, router, self.workdir / "router")

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{s.options.metrics_port}/metrics" for s in self.servers]

    def start(self, ready_timeout: float = READY_TIMEOUT_S) -> "PrismCluster":
        try:
            for server in self.servers:  # load side by side: the model load is most of the wait
                server.launch()
            for server in self.servers:
                server.wait_ready(ready_timeout)
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def heal(self, ready_timeout: float = READY_TIMEOUT_S) -> list[tuple[int, str]]:
        """One look at every replica, no waiting: relaunch those that can no longer answer
        (TritonServer.failure: the server exited or a stub died) on the same ports, and report
        those relaunched earlier that are ready again. While one is down its connections are
        refused: the front fails over to another replica, or answers 503 when none is left, and
        takes it back once its fail_timeout has passed. Not waiting keeps the caller's watch
        loop (and Ctrl-C) responsive while a replica loads. Returns (index, event) pairs:
        "failed (<why>); restarting" and "ready again". A relaunch that exits while loading or
        is not ready within `ready_timeout` raises (TritonServer.started), as a first start does."""
        events = []
        for i, server in enumerate(self.servers):
            if not server.ready:
                if server.started(ready_timeout):
                    events.append((i, "ready again"))
                continue
            reason = server.failure()
            if reason:
                server.kill()
                server.launch()
                events.append((i, f"failed ({reason}); restarting"))
        return events

    def stop(self) -> None:
        """Router first (no new requests reach the replicas), then every replica, gracefully and
        side by side (each unloads its models and ends its stubs)."""
        self.router.stop()
        for server in self.servers:
            server.interrupt()
        for server in self.servers:
            server.wait_stopped()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
