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


def or_error(function, *args):
    """function(*args), or the RequestError it raised: a batch carries it to that request's response."""
    try:
        return function(*args)
    except RequestError as exc:
        return exc


def run_valid(items: list, run) -> tuple[list, object]:
    """Split out the RequestErrors of `items`, run(the rest) -> (one result per item, extra), and
    merge the results back in order. Returns (per item its result or its RequestError, extra)."""
    valid = [i for i, item in enumerate(items) if not isinstance(item, RequestError)]
    results, extra = run([items[i] for i in valid])
    merged = list(items)
    for i, result in zip(valid, results):
        merged[i] = result
    return merged, extra
