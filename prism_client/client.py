"""A small typed client for the `prism` ensemble over Triton's HTTP or gRPC protocol (tritonclient)."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import re
import time
from dataclasses import dataclass, field

import numpy as np

MODEL_NAME = "prism"
REQUEST_TIMEOUT_S = 300.0  # a first request may wait behind a cold instance's batch
# Routing header: a hash of the system prompt and material. A router in front of several servers
# (prism_launcher/router.py: nginx, `hash ... consistent`) sends equal keys to the same server, whose prefix
# cache already holds that material's KV. Requests without it are balanced round-robin.
ROUTE_HEADER = "x-prism-route"
# The request parameter that puts a request in prism_decision's urgent lane (its scheduler serves
# urgent requests before every queued bulk one; prism_backend/serving/scheduler.py).
URGENT_PARAMETERS = {"urgent": True}


def route_key(material: str | bytes, system: str | bytes | None = None) -> str:
    """The routing key of a request: equal for equal (system prompt, material), whatever the tasks."""
    digest = hashlib.sha256(_bytes(system or b""))
    digest.update(b"\x00")
    digest.update(_bytes(material))
    return digest.hexdigest()[:32]


class PrismError(RuntimeError):
    """The server refused or failed a request; `message` is the server's own text."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message if status is None else f"[{status}] {message}")
        self.message = message
        self.status = status


class PrismOverloaded(PrismError):
    """Retry later: the server could not answer within its bound (max_queue_wait_s), or no replica
    is up (restarting after a fault). HTTP 503 / gRPC UNAVAILABLE; nothing was decided. Also
    Triton's 500 for a dead Python-backend stub, in the instant before `prism serve`'s watchdog
    notices it and restarts the replica (prism_launcher/cluster.py). retry_after_s: the server's hint
    ("retry after N s" in its message), or None."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message, status)
        hint = RETRY_HINT.search(message)
        self.retry_after_s = float(hint.group(1)) if hint else None


OVERLOADED_STATUSES = ("503", "StatusCode.UNAVAILABLE")
# Triton 2.51's words for a request that reached a dead stub ("Stub process 'prism_decision_0_0'
# is not healthy."): nothing was decided, and the replica is being restarted.
DEAD_STUB_MESSAGE = re.compile(r"Stub process '[^']*' is not healthy")


# The server's hint in an overload message (prism_backend/serving/scheduler.py, the router's 503):
# tritonclient does not expose HTTP headers such as Retry-After, so the hint travels in the text.
RETRY_HINT = re.compile(r"retry after (\d+(?:\.\d+)?) s")


def server_error(exc) -> PrismError:
    """A tritonclient InferenceServerException as PrismOverloaded or PrismError."""
    status, message = exc.status(), exc.message() or ""
    retryable = status in OVERLOADED_STATUSES or DEAD_STUB_MESSAGE.search(message) is not None
    return (PrismOverloaded if retryable else PrismError)(message, status)


def retry_delays(retries: int, backoff_s: float):
    """Seconds to wait before each retry: exponential backoff with jitter (0.5x-1.5x), so callers
    turned away together do not all come back at the same instant."""
    for attempt in range(retries):
        yield backoff_s * (2 ** attempt) * (0.5 + random.random())


def retry_delay(backoff: float, overloaded: PrismOverloaded) -> float:
    """The wait before a retry: the backoff, or the server's hint if that is longer (spread over
    1x-1.5x of it, so the callers it turned away together do not return together)."""
    if overloaded.retry_after_s is None:
        return backoff
    return max(backoff, overloaded.retry_after_s * (1 + 0.5 * random.random()))


@dataclass(frozen=True)
class Decision:
    task: str
    version: int | None
    label: str
    probabilities: dict[str, float]
    scoring: str
    prompt_ids: list[int] | None = field(default=None, repr=False)
    candidate_ids: list[int] | None = field(default=None, repr=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Decision":
        d = json.loads(text)
        return cls(d["task"], d["version"], d["label"], d["probabilities"], d["scoring"],
                   d.get("prompt_ids"), d.get("candidate_ids"))

    def probability_array(self) -> np.ndarray:
        """float32, in option order: bit-identical to what the engine computed."""
        return np.array(list(self.probabilities.values()), dtype=np.float32)


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def _protocol_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as tc
    elif protocol == "grpc":
        import tritonclient.grpc as tc
    else:
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    return tc


def build_inputs(tc, material, tasks, system=None, return_prompt_ids=False) -> list:
    """The `prism` ensemble's input tensors, for tritonclient module `tc` (http or grpc)."""

    def text_input(name, values):
        array = np.array([_bytes(v) for v in values], dtype=np.object_)
        tensor = tc.InferInput(name, list(array.shape), "BYTES")
        tensor.set_data_from_numpy(array)
        return tensor

    inputs = [text_input("material", [material]), text_input("tasks", list(tasks))]
    if system is not None:
        inputs.append(text_input("system", [system]))
    if return_prompt_ids:
        flag = tc.InferInput("return_prompt_ids", [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        inputs.append(flag)
    return inputs


def infer_options(protocol: str, timeout: float, material, system, urgent: bool) -> dict:
    """Keyword arguments of tritonclient's infer(): routing header, urgent lane, gRPC deadline."""
    options = {"headers": {ROUTE_HEADER: route_key(material, system)}}
    if urgent:
        options["parameters"] = dict(URGENT_PARAMETERS)
    if protocol == "grpc":
        options["client_timeout"] = timeout
    return options


def parse_decisions(result) -> list[Decision]:
    return [Decision.from_json(x) for x in result.as_numpy("decisions").reshape(-1)]


@contextlib.contextmanager
def server_errors():
    """tritonclient's InferenceServerException -> PrismError (PrismOverloaded for 503/UNAVAILABLE)
    with the server's own message."""
    from tritonclient.utils import InferenceServerException

    try:
        yield
    except InferenceServerException as exc:
        raise server_error(exc) from None


class _ClientBase:
    """What the blocking and the asyncio client share: the protocol, the retry policy and the
    request they send.

    retries: how many times an overloaded answer (PrismOverloaded) is retried, with exponential
    backoff from backoff_s; 0 (the default) raises it at once and leaves the choice to the caller."""

    def __init__(self, protocol: str, timeout: float, retries: int, backoff_s: float):
        self.protocol, self.timeout = protocol, timeout
        self.retries, self.backoff_s = retries, backoff_s
        self._tc = _protocol_module(protocol)

    def _infer_call(self, material, tasks, system, return_prompt_ids: bool, urgent: bool) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of tritonclient's infer() for one decide() call."""
        inputs = build_inputs(self._tc, material, tasks, system, return_prompt_ids)
        return (MODEL_NAME, inputs), infer_options(self.protocol, self.timeout, material, system, urgent)


class PrismClient(_ClientBase):
    """Blocking client. tritonclient's HTTP client is not thread-safe: use one per thread."""

    def __init__(self, url: str = "localhost:8000", protocol: str = "http", timeout: float = REQUEST_TIMEOUT_S,
                 retries: int = 0, backoff_s: float = 0.5):
        super().__init__(protocol, timeout, retries, backoff_s)
        if protocol == "http":
            self._client = self._tc.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
        else:
            self._client = self._tc.InferenceServerClient(url)

    def decide(self, material: str | bytes, tasks: list[str], system: str | None = None,
               return_prompt_ids: bool = False, urgent: bool = False) -> list[Decision]:
        """urgent: served before every queued non-urgent request. With retries, an overloaded answer
        is retried after the backoff or the server's hint, whichever is longer."""
        args, kwargs = self._infer_call(material, tasks, system, return_prompt_ids, urgent)
        for delay in [*retry_delays(self.retries, self.backoff_s), None]:
            try:
                with server_errors():
                    return parse_decisions(self._client.infer(*args, **kwargs))
            except PrismOverloaded as overloaded:
                if delay is None:
                    raise
                delay = retry_delay(delay, overloaded)
            time.sleep(delay)

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_model_ready(MODEL_NAME))
        except Exception:
            return False

    def close(self) -> None:
        """Closes its connections: a tritonserver being stopped waits (up to its exit timeout) for
        open keep-alive connections, so a client of one replica should close before the stop."""
        self._client.close()

    def __enter__(self) -> "PrismClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncPrismClient(_ClientBase):
    """asyncio client over tritonclient's aio HTTP or gRPC client; retries as PrismClient."""

    def __init__(self, url: str = "localhost:8000", protocol: str = "http", timeout: float = REQUEST_TIMEOUT_S,
                 retries: int = 0, backoff_s: float = 0.5):
        super().__init__(protocol, timeout, retries, backoff_s)
        if protocol == "http":
            import tritonclient.http.aio as aio

            self._client = aio.InferenceServerClient(url, conn_timeout=timeout)
        else:
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(url)

    async def decide(self, material: str | bytes, tasks: list[str], system: str | None = None,
                     return_prompt_ids: bool = False, urgent: bool = False) -> list[Decision]:
        args, kwargs = self._infer_call(material, tasks, system, return_prompt_ids, urgent)
        for delay in [*retry_delays(self.retries, self.backoff_s), None]:
            try:
                with server_errors():
                    return parse_decisions(await self._client.infer(*args, **kwargs))
            except PrismOverloaded as overloaded:
                if delay is None:
                    raise
                delay = retry_delay(delay, overloaded)
            await asyncio.sleep(delay)

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
