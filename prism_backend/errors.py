"""The errors the adapters tell apart.

A `RequestError` is the user's mistake (bad JSON, unknown task, text too long...). Adapters turn
it into a Triton `INVALID_ARG` error for that request alone; every other request of the batch
goes on. `EngineUnavailable` fails every request (UNAVAILABLE) until the model is reloaded.
Anything else raised inside the engine is a server bug.
"""


class RequestError(ValueError):
    """Invalid input in one request; the message names what is wrong."""


class EngineUnavailable(RuntimeError):
    """The engine cannot score any more (a tensor-parallel worker died); the model must be reloaded."""
