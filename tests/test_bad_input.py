"""Every kind of malformed request gets HTTP 400 naming the problem, sent concurrently with good
requests that all succeed, and the server stays ready."""
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from prism_client.client import PrismClient, PrismError

from helpers import SAMPLE_TICKET


def text(name, values, shape=None):
    return {"name": name, "shape": shape or [len(values)], "datatype": "BYTES", "data": values}


def inline(**task):
    return json.dumps(task)


GOOD = [text("material", [SAMPLE_TICKET]), text("tasks", ["team", "severity"])]
BAD = {
    "missing material": ([text("tasks", ["team"])], "material"),
    "empty material": ([text("material", [" \n "]), text("tasks", ["team"])], "'material' is empty"),
    "zero tasks": ([text("material", ["m"]), text("tasks", [], [0])], "no tasks"),
    "unknown task": ([text("material", ["m"]), text("tasks", ["team", "colour"])], "unknown task 'colour'"),
    "malformed inline JSON": ([text("material", ["m"]), text("tasks", ['{"question": "q", '])], "not valid JSON"),
    "one option": ([text("material", ["m"]), text("tasks", [inline(question="q", options=["a"])])],
                   "at least 2 options"),
    "duplicate options": ([text("material", ["m"]), text("tasks", [inline(question="q", options=["a", "a"])])],
                          "duplicate options"),
    "non-string option": ([text("material", ["m"]), text("tasks", [inline(question="q", options=["a", 7])])],
                          "option 1 must be a non-empty string"),
    "missing question": ([text("material", ["m"]), text("tasks", [inline(options=["a", "b"])])],
                         "missing 'question'"),
    "too many tasks": ([text("material", ["m"]), text("tasks", ["team"] * 33)], "the limit is 32"),
    "too long": ([text("material", ["word " * 9000]), text("tasks", ["team"])], "context"),
    # refused before tokenizing (tests/test_security.py times it)
    "oversized material": ([text("material", ["x" * (1024 * 1024 + 1)]), text("tasks", ["team"])],
                           "'material' is 1048577 bytes; the limit is 1048576 bytes"),
    "binary material": ([text("material", ["PK\u0003\u0004\u0000\u0000binary"]), text("tasks", ["team"])], "NUL"),
    "wrong datatype": ([{"name": "material", "shape": [1], "datatype": "INT32", "data": [5]},
                        text("tasks", ["team"])], "data-type"),
    "wrong shape": ([text("material", ["a", "b"]), text("tasks", ["team"])], "shape"),
}

# Bodies tritonserver's HTTP frontend refuses before any model sees them, with a message naming the
# problem. Triton 2.51 answers them with HTTP 500, though they are the caller's error: its JSON helpers
# report INTERNAL (triton-inference-server/server#8762; docs/serving.md, "Hardened inputs").
UNPARSEABLE = {
    "body not JSON": (b'{"inputs": [', "failed to parse the request JSON buffer"),
    "no inputs member": (b"{}", "Unable to parse 'inputs'"),
    "inputs not a list": (b'{"inputs": 5}', "Unable to parse 'inputs'"),
}


def post(server, inputs):
    return post_body(server, json.dumps({"inputs": inputs}).encode())


def post_body(server, body: bytes):
    url = f"http://localhost:{server.options.http_port}/v2/models/prism/infer"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def invalid_utf8(server):
    client = PrismClient(f"localhost:{server.options.grpc_port}", "grpc")
    try:
        client.decide(b"caf\xe9 \xff\xfe", ["team"])
    except PrismError as exc:
        return exc.status, exc.message
    return "OK", ""


def test_bad_requests_fail_alone_while_good_ones_succeed(server):
    with ThreadPoolExecutor(8) as pool:
        bad = {name: pool.submit(post, server, inputs) for name, (inputs, _) in BAD.items()}
        utf8 = pool.submit(invalid_utf8, server)
        good = [pool.submit(post, server, GOOD) for _ in range(6)]
        for name, future in bad.items():
            code, body = future.result()
            assert code == 400, (name, code, body)
            assert BAD[name][1] in body, (name, body)
        status, message = utf8.result()
        assert status == "StatusCode.INVALID_ARGUMENT" and "not valid UTF-8" in message
        for future in good:
            code, body = future.result()
            assert code == 200, body
            decisions = [json.loads(x) for x in json.loads(body)["outputs"][0]["data"]]
            assert [d["task"] for d in decisions] == ["team", "severity"]
    assert PrismClient(f"localhost:{server.options.http_port}").is_ready()


def test_an_unparseable_body_fails_alone_while_good_requests_succeed(server):
    with ThreadPoolExecutor(6) as pool:
        bad = {name: pool.submit(post_body, server, body) for name, (body, _) in UNPARSEABLE.items()}
        good = [pool.submit(post, server, GOOD) for _ in range(3)]
        for name, future in bad.items():
            code, body = future.result()
            assert code in (400, 500), (name, code, body)
            assert UNPARSEABLE[name][1] in json.loads(body)["error"], (name, body)
        assert [future.result()[0] for future in good] == [200] * 3
    assert PrismClient(f"localhost:{server.options.http_port}").is_ready()


@pytest.mark.parametrize("name", ["empty material", "unknown task"])
def test_bad_request_does_not_change_a_good_ones_bits(server, name):
    """A failing neighbour in the same batch leaves a good request's probabilities untouched."""
    client = PrismClient(f"localhost:{server.options.http_port}")
    alone = [d.probability_array().tobytes() for d in client.decide(SAMPLE_TICKET, ["team"])]
    with ThreadPoolExecutor(4) as pool:
        [pool.submit(post, server, BAD[name][0]) for _ in range(3)]
        mixed = pool.submit(lambda: PrismClient(f"localhost:{server.options.http_port}").decide(SAMPLE_TICKET, ["team"]))
        assert [d.probability_array().tobytes() for d in mixed.result()] == alone
    assert np.frombuffer(alone[0], np.float32).sum() == pytest.approx(1, abs=1e-5)
