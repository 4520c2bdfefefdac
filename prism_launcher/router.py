"""A prefix-aware router in front of several Prism servers: nginx, configured by this module.

Routing: the Prism client sets the header `x-prism-route` to a hash of the request's system prompt
and material (prism_client.client.route_key). nginx sends equal keys to the same replica with
`hash $http_x_prism_route consistent` (ketama: adding or removing a replica moves only that
replica's share of the keys), so a ticket's follow-up questions land where its prefix KV is
cached. Requests without the header go round-robin. Because Prism is deterministic, any replica
returns the same bits; routing only decides where the work is cheapest.

Failover: a replica that refuses connections or answers 502/503/504 is marked failed for
`fail_timeout` seconds (nginx's passive health check) and the request is retried on the next
replica of the ring: inference requests have no side effects, so retrying them is safe
(`non_idempotent`). The same configuration serves HTTP (proxy_pass) and gRPC (grpc_pass, HTTP/2).

Every HTTP response carries `x-prism-replica: <address>`, the replica that answered.

The same nginx is Prism's front in every mode (one replica too, and each Kubernetes pod): the
replicas' tritonservers bind loopback, and the front passes on only an allow-list. Bodies are read
whole before proxying (no chunked stream reaches Triton) and capped at max_request_bytes (413);
inference on the public models, health, metadata, config and statistics go through; the admin
APIs of security.py answer 403 without the admin token; everything else 404. When no replica
answers (all restarting), HTTP callers get a retryable 503 with Retry-After instead of a 502.
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

from prism_client.client import ROUTE_HEADER
from .security import (ADMIN_GRPC_METHODS, ADMIN_HEADER, ADMIN_HTTP_PATHS, TRITON_GRPC_ADMIN_HEADER,
                       validate_admin_token)
from .server import stop_with_parent, wait_until_serving

BALANCES = ("consistent-hash", "round-robin")
NGINX_PACKAGE = "nginx"  # Debian package `make setup` installs
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a material at the model's context is < 1 MiB (docs/security.md)
# What a client of decisions needs, besides inference on PUBLIC_MODELS: health, server and model
# metadata, config, readiness and statistics (perf_analyzer reads them) of any model.
PUBLIC_MODELS = ("prism",)
PUBLIC_HTTP_PATHS = r"^/v2(/health/(live|ready))?$|^/v2/models/[A-Za-z0-9_.-]+(/versions/[0-9]+)?(/ready|/config|/stats)?$"
PUBLIC_GRPC_METHODS = r"^/inference\.GRPCInferenceService/(ServerLive|ServerReady|ModelReady|ServerMetadata" \
                      r"|ModelMetadata|ModelConfig|ModelStatistics|ModelInfer)$|^/grpc\.health\.v1\.Health/Check$"
UPSTREAM_RETRY_AFTER_S = 1  # Retry-After on a replica's overload 503 (its message carries the precise hint)
NO_REPLICA_RETRY_AFTER_S = 5
UNAVAILABLE_MESSAGE = ("no Prism replica is available (starting, restarting after a fault, or overloaded); "
                       f"retry later: retry after {NO_REPLICA_RETRY_AFTER_S} s")


@dataclass(frozen=True)
class Replica:
    http: str  # host:port
    grpc: str
    metrics: str | None = None  # host:port of its metrics endpoint, served by the front


@dataclass
class RouterOptions:
    """The nginx front: the only way in to the replicas' tritonservers, which bind loopback."""
    http_listen: str = "127.0.0.1:8000"
    grpc_listen: str = "127.0.0.1:8001"
    metrics_listen: str | None = None  # None: no metrics port on the front
    balance: str = "consistent-hash"  # round-robin: the baseline of bench/router_bench.py
    fail_timeout_s: int = 10  # how long a failed replica is left out before nginx tries it again
    worker_processes: str = "1"  # "auto" in a container of its own
    # a backstop only: replicas answer admitted requests within max_queue_wait_s (a cold instance's
    # first batch can take longer)
    read_timeout_s: int = 600
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # bigger bodies get 413 from the front
    admin_token: str | None = None  # None: the admin APIs answer 403 to everyone

    def validate(self) -> None:
        if self.balance not in BALANCES:
            raise ConfigError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        if self.fail_timeout_s < 1:
            raise ConfigError(f"fail_timeout_s must be >= 1, got {self.fail_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        validate_admin_token(self.admin_token)


def _header_variable(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def _upstream(name: str, addresses: list[str], hash_key: str | None, fail_timeout_s: int) -> str:
    lines = [f"    upstream {name} {{"]
    if hash_key:
        lines.append(f"        hash {hash_key} consistent;")  # must come before keepalive
    lines += [f"        server {a} max_fails=1 fail_timeout={fail_timeout_s}s;" for a in addresses]
    lines += ["        keepalive 16;", "    }"]
    return "\n".join(lines)


def _json_error(status: int, message: str) -> str:
    return f"return {status} '{{\"error\":\"{message}\"}}\\n';"


def _admin_check(token: str | None, indent: str) -> list[str]:
    """The lines that refuse an admin request without the token (`if` + `return` is safe in nginx)."""
    if token is None:
        return [indent + _json_error(403, f"admin APIs are closed: start prism serve with --admin-token "
                                          f"and send it in {ADMIN_HEADER}")]
    return [f"{indent}if ({_header_variable(ADMIN_HEADER)} != \"{token}\") {{",
            indent + "    " + _json_error(403, f"admin API: send the admin token in {ADMIN_HEADER}"), f"{indent}}}"]


def _http_proxy(tries: int, read_timeout_s: int) -> list[str]:
    return [
        "            proxy_pass http://$prism_http_pool;",
        "            proxy_http_version 1.1;",
        "            proxy_set_header Connection \"\";",
        "            # A dead replica is skipped and the request retried on the next one of the ring. Not on",
        "            # 503: that is a replica refusing work it could not answer within its bound (its scheduler);",
        "            # counted as a failure, it would take the replica out of the ring for fail_timeout.",
        "            proxy_next_upstream error timeout http_502 http_504 non_idempotent;",
        f"            proxy_next_upstream_tries {tries};",
        "            proxy_connect_timeout 2s;",
        f"            proxy_read_timeout {read_timeout_s}s;",
        f"            proxy_send_timeout {read_timeout_s}s;",
    ]


def _grpc_proxy(tries: int, read_timeout_s: int) -> list[str]:
    return [
        "            grpc_pass grpc://$prism_grpc_pool;",
        "            grpc_next_upstream error timeout http_502 http_504 non_idempotent;",
        f"            grpc_next_upstream_tries {tries};",
        "            grpc_connect_timeout 2s;",
        f"            grpc_read_timeout {read_timeout_s}s;",
        f"            grpc_send_timeout {read_timeout_s}s;",
    ]


def _metrics_server(replicas: list[Replica], listen: str) -> list[str]:
    """Each replica's Prometheus text at /replicas/<i>/metrics; with one replica also at /metrics."""
    lines = ["    server {", f"        listen {listen};", "        default_type text/plain;"]
    paths = [(f"/replicas/{i}/metrics", r.metrics) for i, r in enumerate(replicas) if r.metrics]
    if len(replicas) == 1 and replicas[0].metrics:
        paths.append(("/metrics", replicas[0].metrics))
    for path, address in paths:
        lines.append(f"        location = {path} {{ proxy_pass http://{address}/metrics; }}")
    lines += ["        location / { return 404; }", "    }"]
    return lines


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
    http_proxy = _http_proxy(tries, options.read_timeout_s)
    grpc_proxy = _grpc_proxy(tries, options.read_timeout_s)
    infer = "|".join(re.escape(m) for m in PUBLIC_MODELS)
    return "\n".join([
        "# Prism front, rendered by prism_launcher/router.py: nginx in front of the Prism replicas, the only way in.",
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
        "    # Whole bodies are read before anything is proxied, so tritonserver only ever receives a",
        "    # Content-Length body: no chunked stream (Triton < 2.59 crashes on millions of tiny chunks).",
        f"    client_max_body_size {options.max_request_bytes};",
        "    proxy_request_buffering on;",
        "    default_type application/json;",
        "",
        f"    # Requests carrying {ROUTE_HEADER} go to the replica their key hashes to; others round-robin.",
        f"    map {key} $prism_http_pool {{ \"\" prism_http_any; default prism_http_{keyed}; }}",
        f"    map {key} $prism_grpc_pool {{ \"\" prism_grpc_any; default prism_grpc_{keyed}; }}",
        "    # A replica's overload 503 (its scheduler's refusal) gets a Retry-After header; the message",
        "    # itself says how long (\"retry after N s\"), which clients read (nginx cannot).",
        f"    map $upstream_status $prism_retry_after {{ \"503\" \"{UPSTREAM_RETRY_AFTER_S}\"; default \"\"; }}",
        _upstream("prism_http_keyed", http_servers, key, options.fail_timeout_s),
        _upstream("prism_http_any", http_servers, None, options.fail_timeout_s),
        _upstream("prism_grpc_keyed", grpc_servers, key, options.fail_timeout_s),
        _upstream("prism_grpc_any", grpc_servers, None, options.fail_timeout_s),
        "",
        "    server {",
        f"        listen {options.http_listen};",
        "        location = /router/health { return 200 \"ok\\n\"; }",
        "        # Connection refused by every replica (all restarting): a retryable 503, never a bare 502.",
        "        error_page 502 504 = @unavailable;",
        "        location @unavailable {",
        f"            add_header Retry-After {NO_REPLICA_RETRY_AFTER_S} always;",
        "            " + _json_error(503, UNAVAILABLE_MESSAGE),
        "        }",
        "        error_page 413 = @too_large;",
        "        location @too_large {",
        "            " + _json_error(413, f"request body larger than {options.max_request_bytes} bytes "
                                       "(prism serve --max-request-bytes)"),
        "        }",
        f"        location ~ ^/v2/models/({infer})(/versions/[0-9]+)?/infer$ {{",
        *http_proxy,
        "            add_header x-prism-replica $upstream_addr always;",
        "            add_header Retry-After $prism_retry_after always;",
        "        }",
        f"        location ~ {ADMIN_HTTP_PATHS} {{",
        *_admin_check(options.admin_token, "            "),
        *http_proxy,
        "        }",
        f"        location ~ {PUBLIC_HTTP_PATHS} {{",
        *http_proxy,
        "            add_header x-prism-replica $upstream_addr always;",
        "        }",
        "        location / { " + _json_error(404, "not served by the Prism front") + " }",
        "    }",
        "    server {",
        f"        listen {options.grpc_listen} http2;",
        f"        location ~ {ADMIN_GRPC_METHODS} {{",
        *_admin_check(options.admin_token, "            "),
        f"            grpc_set_header {TRITON_GRPC_ADMIN_HEADER} {_header_variable(ADMIN_HEADER)};",
        *grpc_proxy,
        "        }",
        f"        location ~ {PUBLIC_GRPC_METHODS} {{",
        *grpc_proxy,
        "        }",
        "        location / { return 404; }",
        "    }",
        *(_metrics_server(replicas, options.metrics_listen) if options.metrics_listen else []),
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
        self.conf_path.chmod(0o600)  # it may hold the admin token
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
