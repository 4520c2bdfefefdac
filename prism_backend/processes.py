"""Helpers for the processes Prism starts: tensor-parallel workers, tritonserver, the nginx router."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers started on "any free port")."""
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
