"""The `prism` command line: the launcher's commands (setup, serve, export-repository, k8s, cache, bench)
and the client's (decide, determinism-check, health: prism_client/cli.py).

The client's commands only talk HTTP/gRPC: `main` hands them to prism_client before anything of the
engine is imported, so `prism health` (the Kubernetes probe, every few seconds) and `prism decide`
never load prism_backend and torch. The launcher's commands import the engine's configuration and
the launcher's modules inside the functions, for the same reason (tests/test_layout.py checks it).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from prism_client import cli as client_cli

WATCH_INTERVAL_S = 0.25  # how often `prism serve` checks its replicas (and their stubs) are alive


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def ensure_model(model_dir: Path) -> Path:
    """The embedded model is converted on first use; other model dirs must already exist."""
    from prism_backend.paths import DEFAULT_MODEL_DIR

    if Path(model_dir).resolve() == DEFAULT_MODEL_DIR.resolve():
        from .embedded_model import ensure_embedded_model

        ensure_embedded_model(DEFAULT_MODEL_DIR)
    return Path(model_dir)


def cmd_setup(args) -> int:
    print(ensure_model(args.model_dir))
    return 0


def cmd_serve(args) -> int:
    """Replicas (one by default) behind the nginx front on the public ports; the front is the only
    way in (tritonserver binds loopback). A replica whose server exits or whose stub dies is
    restarted while the others keep serving (PrismCluster.heal)."""
    from .cluster import PrismCluster
    from .router import RouterOptions
    from .security import admin_token_from_environment, validate_admin_token
    from .server import LOOPBACK

    token = validate_admin_token(args.admin_token) if args.admin_token else admin_token_from_environment()
    options = _repository_options(args, http_port=args.http_port, grpc_port=args.grpc_port,
                                  metrics_port=args.metrics_port, repository=args.repository, admin_token=token)
    options.validate()  # the public ports must differ too, though the replicas take free ones
    router = RouterOptions(http_listen=f"{args.host}:{args.http_port}", grpc_listen=f"{args.host}:{args.grpc_port}",
                           metrics_listen=f"{args.host}:{args.metrics_port}", balance=args.balance,
                           max_request_bytes=args.max_request_bytes, admin_token=token)
    cluster = PrismCluster(args.replicas, options, router)
    print(f"prism: starting {args.replicas} replica(s) + nginx front (logs: {cluster.workdir})", file=sys.stderr)
    try:
        cluster.start(args.ready_timeout)
    except (RuntimeError, TimeoutError) as exc:  # a replica exited while loading, or never got ready
        print(f"prism: the server did not start: {exc}", file=sys.stderr)
        return 1
    for i, (server, metrics) in enumerate(zip(cluster.servers, cluster.metrics_urls)):
        o = server.options
        print(f"prism: replica {i}: HTTP {LOOPBACK}:{o.http_port}  gRPC {LOOPBACK}:{o.grpc_port}  "
              f"metrics {metrics}", flush=True)
    admin = "admin APIs open to the admin token" if token else "admin APIs closed (no --admin-token)"
    print(f"prism: ready. Front ({args.balance}, {admin}): HTTP {args.host}:{args.http_port}  "
          f"gRPC {args.host}:{args.grpc_port}  metrics http://{args.host}:{args.metrics_port}/"
          f"{'metrics' if args.replicas == 1 else 'replicas/<i>/metrics'}  "
          f"access log {cluster.router.access_log}  (Ctrl-C stops)", flush=True)
    stop = _stop_on_signals()
    try:
        while not stop["now"]:
            if not cluster.router.running():
                print(f"prism: the front exited: {cluster.router.error_tail()}", file=sys.stderr)
                return 1
            try:
                events = cluster.heal(args.ready_timeout)
            except (RuntimeError, TimeoutError) as exc:  # a relaunch that cannot load: stop, say why
                print(f"prism: a replica could not be restarted: {exc}", file=sys.stderr)
                return 1
            for i, event in events:
                print(f"prism: replica {i} {event}", file=sys.stderr, flush=True)
            time.sleep(WATCH_INTERVAL_S)
    finally:
        cluster.stop()
        print("prism: router and replicas stopped", file=sys.stderr)
    return 0


def _stop_on_signals() -> dict:
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def build_parser() -> argparse.ArgumentParser:
    """Every command, the client's included (for --help); builds on the engine's configuration."""
    from prism_backend.paths import DEFAULT_MODEL_DIR

    from .router import BALANCES, DEFAULT_MAX_REQUEST_BYTES
    from .security import ADMIN_HEADER, ADMIN_TOKEN_ENV
    from .server import EXPORT_ENVIRONMENTS, LOOPBACK, READY_TIMEOUT_S

    parser = argparse.ArgumentParser(prog="prism", description="Prism decision engine on Triton")
    sub = parser.add_subparsers(dest="command", required=True)

    setup = sub.add_parser("setup", help="convert the embedded model to safetensors (once)")
    setup.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    setup.set_defaults(func=cmd_setup)

    serve = sub.add_parser("serve", help="start tritonserver on the Prism model repository")
    _add_repository_flags(serve)
    serve.add_argument("--replicas", type=_positive_int, default=1,
                       help="independent servers behind an nginx router on the HTTP/gRPC ports")
    serve.add_argument("--balance", choices=BALANCES, default="consistent-hash",
                       help="router policy with --replicas (consistent-hash on the material)")
    serve.add_argument("--host", default=LOOPBACK,
                       help="address the front listens on (0.0.0.0 in a container); tritonserver "
                            "itself always binds loopback")
    serve.add_argument("--admin-token", default=None,
                       help=f"opens the shared-memory, repository, trace and logging APIs to requests whose "
                            f"{ADMIN_HEADER} header carries it (default: ${ADMIN_TOKEN_ENV}; unset = closed)")
    serve.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get 413 from the front")
    serve.add_argument("--ready-timeout", type=_positive_int, default=int(READY_TIMEOUT_S),
                       help="seconds a replica may take to load its models (int8 calibrates first)")
    serve.add_argument("--repository", type=Path, default=None,
                       help="serve an exported repository (prism export-repository) as it is; its flags were set at export")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.set_defaults(func=cmd_serve)

    export = sub.add_parser("export-repository",
                            help="write a self-contained model repository for an existing Triton (docs/deploy.md)")
    export.add_argument("out", type=Path, help="new folder to write")
    _add_repository_flags(export)
    export.add_argument("--environment", choices=EXPORT_ENVIRONMENTS, default=EXPORT_ENVIRONMENTS[0],
                        help="the Python environment as one archive, unpacked by the server on every start "
                             "(712 MB), or unpacked here into prism_decision/python_env and used in place "
                             "(2.2 GB; starts ~20 s sooner: images, local model stores)")
    export.set_defaults(func=cmd_export_repository)

    client_cli.add_commands(sub)  # decide, determinism-check, health

    k8s = sub.add_parser("k8s", help="print the --replicas layout as Kubernetes manifests (router as entry point)")
    k8s.add_argument("--replicas", type=_positive_int, default=2)
    k8s.add_argument("--image", default="prism:latest",
                     help="NVIDIA's Triton image with an exported repository at /models (deploy/Dockerfile)")
    k8s.add_argument("--namespace", default="default")
    k8s.set_defaults(func=cmd_k8s)

    cache = sub.add_parser("cache", help="Prism's caches on this machine (calibration, exported environments): "
                                         "size against limit, entries by last use")
    cache.add_argument("--evict", action="store_true",
                       help="apply the limits now (e.g. after lowering PRISM_CALIBRATION_CACHE_LIMIT)")
    cache.set_defaults(func=cmd_cache)

    bench = sub.add_parser("bench", help="Prism vs vLLM vs Hugging Face side by side (bench/side_by_side.py)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed on, e.g. --repeats 5 --quick")
    bench.set_defaults(func=cmd_bench)
    return parser


def _add_repository_flags(parser: argparse.ArgumentParser) -> None:
    """How the model repository is rendered: the same flags for `serve` and `export-repository`."""
    from prism_backend.config import PRECISIONS
    from prism_backend.paths import DEFAULT_MODEL_DIR

    parser.add_argument("--precision", choices=PRECISIONS, default="int8")
    parser.add_argument("--instances", type=_positive_int, default=1, help="prism_decision instances (DP)")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree per instance")
    parser.add_argument("--max-batch-size", type=_positive_int, default=None,
                        help="prism_decision's max_batch_size (default: config.pbtxt's)")
    parser.add_argument("--max-queue-wait-s", type=float, default=None,
                        help="an admitted request is answered within this many seconds; one that could not be "
                             "gets 503 / UNAVAILABLE at once, with a retry hint (default 10)")
    parser.add_argument("--parameter", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                        help="a prism_decision config.pbtxt parameter (prefix_cache_bytes=0, act_passes=1, ...)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="Hugging Face checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _repository_options(args, **server):
    """The ServerOptions the flags of _add_repository_flags describe."""
    from .server import ServerOptions

    exported = server.get("repository") is not None  # it carries its own checkpoint
    return ServerOptions(precision=args.precision, instances=args.instances, tp=args.tp,
                         model_dir=args.model_dir if exported else ensure_model(args.model_dir),
                         max_batch_size=args.max_batch_size, max_queue_wait_s=args.max_queue_wait_s,
                         extra_parameters=dict(args.parameter), **server)


def cmd_export_repository(args) -> int:
    from .export import export_repository

    start = time.monotonic()
    out = export_repository(_repository_options(args), args.out, log=lambda m: print(m, file=sys.stderr),
                            environment=args.environment)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"prism: exported {out} ({size / 2**30:.2f} GiB, {time.monotonic() - start:.0f} s); "
          f"serve it with: tritonserver --model-repository={out.resolve()}")
    return 0


def cmd_k8s(args) -> int:
    from .kubernetes import manifest

    sys.stdout.write(manifest(args.replicas, args.image, args.namespace))
    return 0


def cmd_cache(args) -> int:
    """Each user cache: its folder, size and limit, and its entries, least recently used first
    (the first to go); with --evict the limits applied first."""
    from prism_backend import cache_eviction
    from prism_backend.engine import calibration

    from . import execution_env

    caches = [("calibration", calibration.cache_dir(), calibration.entry_key,
               calibration.LIMIT_VARIABLE, calibration.DEFAULT_LIMIT),
              ("execution environments", execution_env.default_cache_dir(), execution_env.archive_key,
               execution_env.LIMIT_VARIABLE, execution_env.DEFAULT_LIMIT)]
    for name, folder, key_of, variable, default in caches:
        if folder is None:
            print(f"{name}: off")
            continue
        max_bytes = cache_eviction.limit(variable, default)
        if args.evict:
            for key in cache_eviction.evict(folder, max_bytes, key_of):
                print(f"prism: removed the {name} entry {key}")
        found = cache_eviction.entries(folder, key_of)
        limit = "no limit" if max_bytes is None else f"limit {max_bytes / 2**30:.2f} GiB"
        print(f"{name}: {folder}: {sum(e.bytes for e in found) / 2**30:.2f} GiB in {len(found)} "
              f"entries, {limit} ({variable})")
        for entry in found:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_use_ns / 1e9))
            print(f"  {entry.key}  {entry.bytes / 2**20:8.1f} MiB  last used {used}")
    return 0


def cmd_bench(args) -> int:
    """`make bench` without make: bench/side_by_side.py from this checkout (needs .venv-vllm for vLLM)."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "bench" / "side_by_side.py"
    if not script.exists():
        raise FileNotFoundError(f"{script} not found: `prism bench` runs from a Prism checkout")
    return subprocess.call([sys.executable, str(script), *args.bench_args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in client_cli.COMMANDS:
        return client_cli.main(argv, prog="prism")  # before anything of the engine is imported
    args = build_parser().parse_args(argv)
    from prism_backend.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"prism: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
