"""Errors that belong to one request.

A `RequestError` is the user's mistake (bad JSON, unknown task, text too long...). Adapters turn
it into a Triton `INVALID_ARG` error for that request alone; every other request of the batch
goes on. Anything else raised inside the engine is a server bug.
"""


class RequestError(ValueError):
    """Invalid input in one request; the message names what is wrong."""
