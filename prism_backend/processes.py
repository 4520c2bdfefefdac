"""Helpers for the processes Prism starts: tensor-parallel workers, tritonserver, the nginx router."""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

from .config import ConfigError

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """From now on the kernel sends `sig` to this process when its parent dies (Linux only; a no-op
    elsewhere). In a `preexec_fn` it covers the program the child goes on to exec."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 10000  # free_port's ports: from here up to the kernel's ephemeral range
_port_lock = threading.Lock()
_next_port: list[int] = []  # this process's next candidate (an offset into free_port's range), drawn once


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers started on "any free port").

    Drawn from below the kernel's ephemeral range, not by binding port 0: a port from that range can be
    taken, between this call and the server's bind, as the local port of any outgoing connection on the
    machine, and the server then fails to start (nginx did in a CI run, 2026-12-07: "bind() to
    127.0.0.1:39303 failed (98: Address already in use)"). A process walks the range from a random
    place, so it never hands out one port twice and two processes rarely meet; binding port 0 is the
    fallback where the range leaves no room below it."""
    low, _ = ephemeral_ports()
    size = low - LISTEN_PORTS_FROM
    if size >= 1000:
        with _port_lock:
            if not _next_port:
                _next_port.append(random.randrange(size))
            for _ in range(256):
                port = LISTEN_PORTS_FROM + _next_port[0] % size
                _next_port[0] += 1
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_executable() -> str:
    """The interpreter for worker processes. Inside Triton's Python backend sys.executable is the
    stub, not Python: the launcher exports PRISM_PYTHON; elsewhere the running interpreter."""
    for candidate in (os.environ.get("PRISM_PYTHON"), sys.executable, shutil.which("python3")):
        if candidate and "python" in os.path.basename(candidate):
            return candidate
    raise ConfigError("cannot find a Python interpreter for tensor-parallel workers; set PRISM_PYTHON")
