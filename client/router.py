"""A prefix-aware router in front of several Prism servers: nginx, configured by this module.

Routing: the Prism client sets the header `x-prism-route` to a hash of the request's system prompt
and material (client.route_key). nginx sends equal keys to the same replica with
`hash $http_x_prism_route consistent` (ketama: adding or removing a replica moves only that
replica's share of the keys), so a ticket's follow-up questions land where its prefix KV is
cached. Requests without the header go round-robin. Because Prism is deterministic, any replica
returns the same bits; routing only decides where the work is cheapest.

Failover: a replica that refuses connections or answers 502/503/504 is marked failed for
`fail_timeout` seconds (nginx's passive health check) and the request is retried on the next
replica of the ring: inference requests have no side effects, so retrying them is safe
(`non_idempotent`). The same configuration serves HTTP (proxy_pass) and gRPC (grpc_pass, HTTP/2).

Every HTTP response carries `x-prism-replica: <address>`, the replica that answered.
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prism_backend.config import ConfigError

from .client import ROUTE_HEADER
from .server import stop_with_parent, wait_until_serving

BALANCES = ("consistent-hash", "round-robin")
NGINX_PACKAGE = "nginx"  # Debian package `make setup` installs


@dataclass(frozen=True)
class Replica:
    http: str  # host:port
    grpc: str


@dataclass
class RouterOptions:
    http_listen: str = "127.0.0.1:8000"
    grpc_listen: str = "127.0.0.1:8001"
    balance: str = "consistent-hash"  # round-robin: the baseline of bench/router_bench.py
    fail_timeout_s: int = 10  # how long a failed replica is left out before nginx tries it again
    worker_processes: str = "1"  # "auto" in a container of its own
    read_timeout_s: int = 600  # a bulk request can queue behind other batches for minutes

    def validate(self) -> None:
        if self.balance not in BALANCES:
            raise ConfigError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        if self.fail_timeout_s < 1:
            raise ConfigError(f"fail_timeout_s must be >= 1, got {self.fail_timeout_s}")


def _header_variable(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def _upstream(name: str, addresses: list[str], hash_key: str | None, fail_timeout_s: int) -> str:
    lines = [f"    upstream {name} {{"]
    if hash_key:
        lines.append(f"        hash {hash_key} consistent;")  # must come before keepalive
    lines += [f"        server {a} max_fails=1 fail_timeout={fail_timeout_s}s;" for a in addresses]
    lines += ["        keepalive 16;", "    }"]
    return "\n".join(lines)


def render_nginx_conf(replicas: list[Replica], options: RouterOptions, workdir: str | None) -> str:
    """nginx.conf for `replicas`. workdir: where pid, logs and temp files go (None: a container,
    logging to stdout/stderr with the image's default paths)."""
    options.validate()
    if not replicas:
        raise ConfigError("the router needs at least one replica")
    key = _header_variable(ROUTE_HEADER)
    keyed = "keyed" if options.balance == "consistent-hash" else "any"
    tries = len(replicas)
    if workdir is None:
        process = ["error_log stderr warn;"]
        paths, access_log = [], "/dev/stdout"
    else:
        process = [f"pid {workdir}/nginx.pid;", f"error_log {workdir}/error.log warn;"]
        if os.geteuid() == 0:  # nginx started by root would run its workers as an unprivileged user
            process.append(f"user {getpass.getuser()};")
        paths = [f"    {kind}_temp_path {workdir}/{kind}_temp;"
                 for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]
        access_log = f"{workdir}/access.log"
    http_servers = [r.http for r in replicas]
    grpc_servers = [r.grpc for r in replicas]
    return "\n".join([
        "# Prism router, rendered by client/router.py: nginx in front of the Prism replicas.",
        "daemon off;",
        f"worker_processes {options.worker_processes};",
        *process,
        "events { worker_connections 1024; }",
        "http {",
        "    log_format prism '$time_iso8601 $request_method $uri route=" + key + " '",
        "                     'upstream=$upstream_addr status=$status upstream_status=$upstream_status '",
        "                     'seconds=$request_time';",
        f"    access_log {access_log} prism;",
        *paths,
        "    client_max_body_size 64m;",
        "",
        f"    # Requests carrying {ROUTE_HEADER} go to the replica their key hashes to; others round-robin.",
        f"    map {key} $prism_http_pool {{ \"\" prism_http_any; default prism_http_{keyed}; }}",
        f"    map {key} $prism_grpc_pool {{ \"\" prism_grpc_any; default prism_grpc_{keyed}; }}",
        _upstream("prism_http_keyed", http_servers, key, options.fail_timeout_s),
        _upstream("prism_http_any", http_servers, None, options.fail_timeout_s),
        _upstream("prism_grpc_keyed", grpc_servers, key, options.fail_timeout_s),
        _upstream("prism_grpc_any", grpc_servers, None, options.fail_timeout_s),
        "",
        "    server {",
        f"        listen {options.http_listen};",
        "        location = /router/health { return 200 \"ok\\n\"; }",
        "        location / {",
        "            proxy_pass http://$prism_http_pool;",
        "            proxy_http_version 1.1;",
        "            proxy_set_header Connection \"\";",
        "            # A dead replica is skipped and the request retried on the next one of the ring.",
        "            proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;",
        f"            proxy_next_upstream_tries {tries};",
        "            proxy_connect_timeout 2s;",
        f"            proxy_read_timeout {options.read_timeout_s}s;",
        f"            proxy_send_timeout {options.read_timeout_s}s;",
        "            add_header x-prism-replica $upstream_addr always;",
        "        }",
        "    }",
        "    server {",
        f"        listen {options.grpc_listen} http2;",
        "        location / {",
        "            grpc_pass grpc://$prism_grpc_pool;",
        "            grpc_next_upstream error timeout http_502 http_503 http_504 non_idempotent;",
        f"            grpc_next_upstream_tries {tries};",
        "            grpc_connect_timeout 2s;",
        f"            grpc_read_timeout {options.read_timeout_s}s;",
        f"            grpc_send_timeout {options.read_timeout_s}s;",
        "        }",
        "    }",
        "}",
        "",
    ])


ACCESS_LOG_FIELDS = re.compile(r"(\w+)=((?:[^\s,]+, )*\S+)")  # upstream=a, b when a failed


def read_access_log(path: Path) -> list[dict[str, str]]:
    """The router's access log (log_format prism) as dicts: route, upstream, status, seconds...
    `upstream` lists every replica tried, comma-separated, when the first one failed."""
    entries = []
    for line in Path(path).read_text().splitlines():
        time_iso, method, uri, rest = line.split(" ", 3)
        entries.append({"time": time_iso, "method": method, "uri": uri, **dict(ACCESS_LOG_FIELDS.findall(rest))})
    return entries


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if path is None:
        raise FileNotFoundError(f"nginx not found; install the Debian package `{NGINX_PACKAGE}` "
                                "(`make serve` and `make test` do)")
    return path


def _port(listen: str) -> int:
    return int(listen.rsplit(":", 1)[-1])


class NginxRouter:
    """An nginx process serving render_nginx_conf(replicas, options) from `workdir`."""

    def __init__(self, replicas: list[Replica], options: RouterOptions, workdir: Path):
        self.replicas, self.options, self.workdir = replicas, options, Path(workdir)
        self.conf_path = self.workdir / "nginx.conf"
        self.process: subprocess.Popen | None = None

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    def _command(self, *extra: str) -> list[str]:
        return [nginx_binary(), "-p", str(self.workdir), "-c", str(self.conf_path),
                "-e", str(self.workdir / "error.log"), *extra]

    def write_conf(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(render_nginx_conf(self.replicas, self.options, str(self.workdir)))
        check = subprocess.run(self._command("-t", "-q"), capture_output=True, text=True)
        if check.returncode != 0:
            raise ConfigError(f"nginx rejected {self.conf_path}: {check.stderr.strip()}")
        return self.conf_path

    def start(self, ready_timeout: float = 30.0) -> "NginxRouter":
        self.write_conf()
        self.process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=stop_with_parent)
        port = _port(self.options.http_listen)
        if wait_until_serving(self.process, port, "/router/health", ready_timeout, 0.1,
                              lambda code: f"nginx exited with code {code}: {self.error_tail()}"):
            return self
        self.stop()
        raise TimeoutError(f"nginx not answering on port {port} after {ready_timeout:.0f} s: {self.error_tail()}")

    def error_tail(self) -> str:
        try:
            return (self.workdir / "error.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no error log)"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGQUIT: nginx finishes the requests in flight, then exits (SIGKILL after `timeout`)."""
        if not self.running():
            return
        self.process.send_signal(signal.SIGQUIT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
