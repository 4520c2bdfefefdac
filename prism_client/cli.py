"""The client's commands: decide, determinism-check, health. They only talk HTTP/gRPC to a running
server, so they load neither the engine nor torch: `prism health`, the Kubernetes probe, runs every
few seconds in each pod.

The launcher's `prism` (prism_launcher/cli.py) registers these same commands next to its own and
hands them to `main` here; `python -m prism_client` runs them without the launcher.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMANDS = ("decide", "determinism-check", "health")
HEALTH_PROBE_MATERIAL = "Health probe."


def cmd_decide(args) -> int:
    from .client import PrismClient, PrismError

    material = Path(args.material).read_text(encoding="utf-8")
    client = PrismClient(args.url or ("localhost:8001" if args.grpc else "localhost:8000"),
                         "grpc" if args.grpc else "http")
    try:
        decisions = client.decide(material, args.task, system=args.system, urgent=args.urgent)
    except PrismError as exc:
        print(f"prism: {exc}", file=sys.stderr)
        return 1
    print(json.dumps([d.__dict__ for d in decisions], indent=2) if args.json else format_decisions(decisions))
    return 0


def format_decisions(decisions) -> str:
    """`prism decide`'s table: per task its label, then each option's probability as a bar."""
    lines = []
    for d in decisions:
        lines.append(f"{d.task if d.version is None else f'{d.task}@{d.version}'}: {d.label}")
        for option, p in d.probabilities.items():
            lines.append(f"  {'*' if option == d.label else ' '} {p:7.2%}  {'#' * round(p * 30):<30}  {option}")
    return "\n".join(lines)


def cmd_health(args) -> int:
    """Exit 0 if the server at --url answers a small decision (or is merely overloaded: 503),
    1 otherwise. For Kubernetes probes: Triton 2.51 keeps reporting ready with a dead stub, and
    only a request shows it ("Stub process ... is not healthy")."""
    from .client import PrismClient, PrismError, PrismOverloaded

    client = PrismClient(args.url, timeout=args.timeout)
    try:
        client.decide(HEALTH_PROBE_MATERIAL, ["team"])
    except PrismOverloaded:
        return 0  # alive and busy: restarting it would only lose the queue
    except PrismError as exc:
        print(f"prism: unhealthy: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # refused connection, timeout...
        print(f"prism: unhealthy: {exc!r}", file=sys.stderr)
        return 1
    return 0


def cmd_determinism_check(args) -> int:
    from .determinism_check import load_recording, run_check, save_recording

    url = args.url or ("localhost:8001" if args.grpc else "localhost:8000")
    recorded = load_recording(args.replay) if args.replay else None
    ok, rows, digests = run_check(url, "grpc" if args.grpc else "http", rounds=args.rounds, recorded=recorded)
    for setting, sent, mismatches in rows:
        print(f"{setting:<30} {sent:>4} requests  {mismatches} mismatches")
    if args.save:
        save_recording(args.save, digests, url)
        print(f"recorded the digests in {args.save}")
    print("determinism: bit-identical" if ok else "determinism: MISMATCH")
    return 0 if ok else 1


def add_commands(sub) -> None:
    """Add the client's commands to an argparse subparsers object (this module's parser, `prism`'s)."""
    decide = sub.add_parser("decide", help="ask a running server for decisions about a document")
    decide.add_argument("--material", required=True, help="file holding the document")
    decide.add_argument("--task", action="append", required=True,
                        help="registered task (team, severity@1) or inline JSON; repeat for several")
    decide.add_argument("--system", default=None, help="replace the default system prompt")
    decide.add_argument("--url", default=None, help="server address (default localhost:8000, gRPC 8001)")
    decide.add_argument("--grpc", action="store_true", help="use gRPC instead of HTTP")
    decide.add_argument("--json", action="store_true", help="print JSON instead of a table")
    decide.add_argument("--urgent", action="store_true",
                        help="the urgent lane: served ahead of every queued non-urgent request")
    decide.set_defaults(func=cmd_decide)

    check = sub.add_parser("determinism-check",
                           help="check a running server returns identical bits however requests are batched")
    check.add_argument("--url", default=None, help="server address (default localhost:8000, gRPC 8001)")
    check.add_argument("--grpc", action="store_true")
    check.add_argument("--rounds", type=int, default=3, help="times each request is sent per concurrency")
    check.add_argument("--save", default=None, metavar="FILE",
                       help="write the digests answered alone to FILE, to replay on another machine")
    check.add_argument("--replay", default=None, metavar="FILE",
                       help="also compare with a --save recording (same model and configuration, any x86-64 CPU)")
    check.set_defaults(func=cmd_determinism_check)

    health = sub.add_parser("health", help="exit 0 if a server answers a small decision (Kubernetes probes)")
    health.add_argument("--url", default="127.0.0.1:8000", help="HTTP address of the server")
    health.add_argument("--timeout", type=float, default=20.0)
    health.set_defaults(func=cmd_health)


def build_parser(prog: str = "python -m prism_client") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Prism client: ask a running Prism server")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def run(args) -> int:
    """Run parsed arguments of a client command (from this module's parser or `prism`'s)."""
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:  # a --material or --replay file missing or malformed
        print(f"prism: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None, prog: str = "python -m prism_client") -> int:
    return run(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
