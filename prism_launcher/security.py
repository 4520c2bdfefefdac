"""What Prism lets through to tritonserver, in one place: the admin token and the API groups it guards.

Triton 2.51 (the binary in nvidia-pytriton 0.7.0) has public holes fixed only in 2.59: a chunked
HTTP body of millions of tiny chunks crashes its HTTP frontend, and its system shared-memory API
lets any client map the Python backend's IPC memory (docs/security.md). Prism therefore never
exposes tritonserver itself: it binds loopback, and the nginx front (router.py) is the only way in.
Both layers use the definitions below:
- the front forwards the admin APIs only for requests carrying ADMIN_HEADER = the admin token
  (403 otherwise, and always when no token is set);
- tritonserver restricts the same API groups to the same header (`--http-restricted-api`,
  `--grpc-restricted-protocol`), so a local process that reaches its loopback ports directly
  still needs the token. With no token set it gets a random one nobody knows: closed.
"""
from __future__ import annotations

import os
import re
import secrets

from prism_backend.config import ConfigError

ADMIN_HEADER = "x-prism-admin-token"
ADMIN_TOKEN_ENV = "PRISM_ADMIN_TOKEN"
# Triton's gRPC server looks for a restricted protocol's header under this prefix (2.51: "This
# protocol is restricted, expecting header 'triton-grpc-protocol-<key>'"); the front adds it.
TRITON_GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
# Triton's names for the API groups a client of decisions never needs (tritonserver --help).
ADMIN_APIS = ("shared-memory", "model-repository", "trace", "logging")
# The same groups as HTTP paths and gRPC methods, for the front's allow-list.
ADMIN_HTTP_PATHS = r"^/v2/(systemsharedmemory|cudasharedmemory|repository|trace|logging)(/|$)" \
                   r"|^/v2/models/[^/]+(/versions/[0-9]+)?/trace/setting$"
ADMIN_GRPC_METHODS = r"^/inference\.GRPCInferenceService/" \
                     r"(SystemSharedMemory\w+|CudaSharedMemory\w+|Repository\w+|TraceSetting|LogSettings)$"
# A token is written into nginx.conf and tritonserver's command line: no quoting needed for these.
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")


def validate_admin_token(token: str | None) -> str | None:
    if token is not None and not TOKEN_PATTERN.fullmatch(token):
        raise ConfigError(f"the admin token must be 16-256 characters of [A-Za-z0-9._~+/=-] "
                          f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def admin_token_from_environment() -> str | None:
    return validate_admin_token(os.environ.get(ADMIN_TOKEN_ENV) or None)


def triton_restriction_flags(token: str | None, checked: bool = True) -> list[str]:
    """tritonserver flags that restrict ADMIN_APIS to requests carrying ADMIN_HEADER: token
    (a random, unknown token when none is set, which closes them). checked=False takes a
    placeholder the caller's platform fills in, e.g. Kubernetes' $(VAR)."""
    value = (validate_admin_token(token) if checked else token) or secrets.token_urlsafe(32)
    apis = ",".join(ADMIN_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={value}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={value}"]
