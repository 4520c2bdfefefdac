"""Several Prism servers on one machine behind the nginx router (`prism serve --replicas N`).

The local form of the production layout (docs/scale-out.md): N independent tritonservers, each
with its own prefix cache, and a router that sends requests about the same material to the same
replica. Replicas listen on free loopback ports; only the router's ports are the public ones.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from prism_backend.config import ConfigError
from prism_backend.processes import free_port

from .router import NginxRouter, Replica, RouterOptions
from .server import READY_TIMEOUT_S, RUN_DIR, ServerOptions, TritonServer


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
        addresses = [Replica(f"127.0.0.1:{s.options.http_port}", f"127.0.0.1:{s.options.grpc_port}")
                     for s in self.servers]
        self.router = NginxRouter(addresses, router, self.workdir / "router")

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s.options.metrics_port}/metrics" for s in self.servers]

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

    def restart_dead(self, ready_timeout: float = READY_TIMEOUT_S) -> list[int]:
        """Start again the replicas whose server exited (same ports: the router takes each back
        once its fail_timeout has passed). Returns their indices."""
        dead = [i for i, s in enumerate(self.servers) if s.process is not None and not s.running()]
        for i in dead:
            self.servers[i].start(ready_timeout)
        return dead

    def stop(self) -> None:
        """Router first (no new requests reach the replicas), then every replica, gracefully."""
        self.router.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
