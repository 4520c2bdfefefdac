"""End to end: a real tritonserver (started by the `server` fixture), real HTTP and gRPC calls."""
import json
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from prism_client.client import PrismClient, PrismError

from helpers import REPO_ROOT, SAMPLE_TICKET, metric, processes_with, run_snippet, scrape
from prism_launcher.server import MODEL_ENVIRONMENT

TASKS = ["team", "reply_time", "severity@1", '{"question": "Is the customer angry?", "options": ["Yes", "No"]}']


def http_client(server):
    return PrismClient(f"localhost:{server.options.http_port}", "http")


def grpc_client(server):
    return PrismClient(f"localhost:{server.options.grpc_port}", "grpc")


@pytest.mark.parametrize("make_client", [http_client, grpc_client], ids=["http", "grpc"])
def test_decisions_match_hf_reference(server, hf_reference, make_client):
    decisions = make_client(server).decide(SAMPLE_TICKET, TASKS, return_prompt_ids=True)
    assert [d.task for d in decisions] == ["team", "reply_time", "severity", "inline"]
    assert [d.version for d in decisions] == [1, 1, 1, None]
    for d in decisions:
        assert d.label == max(d.probabilities, key=d.probabilities.get)
        assert d.scoring == "candidates"
        ref = hf_reference.candidate_probabilities(d.prompt_ids, d.candidate_ids)
        np.testing.assert_allclose(d.probability_array(), ref, atol=1e-5, rtol=0)


def test_http_and_grpc_return_identical_bits(server):
    a = http_client(server).decide(SAMPLE_TICKET, TASKS)
    b = grpc_client(server).decide(SAMPLE_TICKET, TASKS)
    assert [d.probability_array().tobytes() for d in a] == [d.probability_array().tobytes() for d in b]


# The fp32 pipeline in a process with the server's model environment: fp32's products are MKL's, whose
# bits follow its code branch, and the launcher starts the models on MKL_CBWR=AUTO,STRICT whatever the
# suite's process runs (the forced AVX2 path's COMPATIBLE,STRICT: this test failed there, 2026-12-06)
LOCAL_FP32_DECISION = """
import json, sys
from helpers import REGISTRY, SAMPLE_TICKET
from prism_backend.config import EngineConfig
from prism_backend.serving.pipeline import DecisionPipeline
pipeline = DecisionPipeline(EngineConfig(model_dir=sys.argv[1], precision="fp32", prefix_cache_bytes=0), REGISTRY)
print(json.dumps([list(d["probabilities"].values()) for d in pipeline.decide(SAMPLE_TICKET, ["severity", "team"])]))
"""


def test_server_agrees_with_in_process_pipeline(server, model_dir):
    """Same engine behind Triton: identical float32 bits, and the JSON round-trips them exactly."""
    remote = http_client(server).decide(SAMPLE_TICKET, ["severity", "team"])
    local = run_snippet(LOCAL_FP32_DECISION, model_dir, env=MODEL_ENVIRONMENT)  # float32 values, exact through JSON's doubles
    assert len(remote) == len(local) == 2
    for r, l in zip(remote, local):
        assert r.probability_array().tobytes() == np.array(l, np.float32).tobytes()


def test_custom_system_prompt_changes_the_prompt(server):
    client = http_client(server)
    default = client.decide("My invoice is wrong.", ["team"], return_prompt_ids=True)[0]
    custom = client.decide("My invoice is wrong.", ["team"], system="You route tickets.", return_prompt_ids=True)[0]
    assert default.prompt_ids != custom.prompt_ids
    assert default.candidate_ids == custom.candidate_ids


def test_unknown_task_is_http_400_while_good_request_succeeds(server):
    def decide(tasks):  # one client per call: tritonclient's HTTP client is not thread-safe
        return http_client(server).decide(SAMPLE_TICKET, tasks)

    with ThreadPoolExecutor(4) as pool:
        bad = [pool.submit(decide, ["team", "no_such_task"]) for _ in range(2)]
        good = [pool.submit(decide, ["severity"]) for _ in range(2)]
        for f in bad:
            with pytest.raises(PrismError) as info:
                f.result()
            assert info.value.status == "400" and "no_such_task" in info.value.message
        for f in good:
            assert f.result()[0].task == "severity"
    assert http_client(server).is_ready()


def test_grpc_error_is_invalid_argument(server):
    with pytest.raises(PrismError) as info:
        grpc_client(server).decide(SAMPLE_TICKET, ['{"question": "q", "options": ["only one"]}'])
    assert info.value.status == "StatusCode.INVALID_ARGUMENT" and "at least 2 options" in info.value.message


def test_plain_http_json_request(server):
    """What the README's curl example sends."""
    body = {"inputs": [
        {"name": "material", "shape": [1], "datatype": "BYTES", "data": ["My invoice is wrong."]},
        {"name": "tasks", "shape": [2], "datatype": "BYTES", "data": ["team", "severity"]},
    ]}
    url = f"http://localhost:{server.options.http_port}/v2/models/prism/infer"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        out = json.loads(r.read())
    decisions = [json.loads(x) for x in out["outputs"][0]["data"]]
    assert [d["task"] for d in decisions] == ["team", "severity"]
    body["inputs"][1]["data"] = ["team", "{not json"]
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 400 and "not valid JSON" in info.value.read().decode()


def test_cli_decide_prints_table(server):
    out = subprocess.run(
        [sys.executable, "-m", "prism_launcher.cli", "decide", "--material", str(REPO_ROOT / "samples" / "ticket.txt"),
         "--task", "severity", "--task", "team", "--url", f"localhost:{server.options.http_port}"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "severity@2:" in out and "team@1:" in out and "%" in out


def test_cli_reports_server_error(server):
    done = subprocess.run(
        [sys.executable, "-m", "prism_client", "decide", "--material", str(REPO_ROOT / "samples" / "ticket.txt"),
         "--task", "nope", "--grpc", "--url", f"localhost:{server.options.grpc_port}"],
        capture_output=True, text=True,
    )
    assert done.returncode == 1 and "unknown task 'nope'" in done.stderr


def test_concurrent_callers_share_one_forest(server):
    """Three callers, one question each about the same ticket: only cross-request batching can
    make the shared-prefix hit rate positive, since no single request shares anything; the idle
    scheduler waits for all three (they arrive a few ms apart) and scores them in one forest. The
    first round only tells it that requests come in groups: after the earlier tests' lone requests
    it may start the first of them at once."""
    def ask(task):
        return http_client(server).decide(SAMPLE_TICKET, [task])[0]

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(ask, ["team", "reply_time", "severity"]))
        before = scrape(server)
        for _ in range(4):
            assert [d.task for d in pool.map(ask, ["team", "reply_time", "severity"])] == \
                   ["team", "reply_time", "severity"]
    after = scrape(server)
    computed = metric(after, "prism_tokens_computed_total") - metric(before, "prism_tokens_computed_total")
    generic = metric(after, "prism_tokens_generic_total") - metric(before, "prism_tokens_generic_total")
    assert metric(after, "prism_requests_total") - metric(before, "prism_requests_total") == 12
    assert computed < generic  # shared material computed once for batched callers
    batches = metric(after, "prism_execution_batch_size_count") - metric(before, "prism_execution_batch_size_count")
    assert batches == 4  # each round's three requests gathered into one forest (the scheduler's gather_ms)
    assert 0 < metric(after, "prism_shared_prefix_hit_rate") < 1


def test_standing_metrics_are_exported(server):
    http_client(server).decide(SAMPLE_TICKET, ["team", "severity"])
    values = scrape(server)
    for name in ("prism_requests_total", "prism_tasks_total", "prism_request_errors_total",
                 "prism_fallback_tasks_total", "prism_candidates_per_task", "prism_determinism_self_check",
                 "prism_execution_seconds_count", "prism_execution_batch_size_bucket",
                 "prism_prefix_cache_tokens_reused_total", "prism_engine_available"):
        assert any(k.startswith(name) for k in values), name
    assert metric(values, "prism_tasks_total") >= 2
    assert 2 <= metric(values, "prism_candidates_per_task") <= 26


def test_task_versions_served_side_by_side(server):
    client = http_client(server)
    v1, v2, latest = client.decide(SAMPLE_TICKET, ["severity@1", "severity@2", "severity"], return_prompt_ids=True)
    assert (v1.version, v2.version, latest.version) == (1, 2, 2)
    assert v1.prompt_ids != v2.prompt_ids and v2.prompt_ids == latest.prompt_ids
    assert v2.probability_array().tobytes() == latest.probability_array().tobytes()
    with pytest.raises(PrismError) as info:
        client.decide(SAMPLE_TICKET, ["severity@3"])
    assert info.value.status == "400" and "available versions: [1, 2]" in info.value.message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_asyncio_client(server, protocol):
    import asyncio

    from prism_client.client import AsyncPrismClient

    port = server.options.http_port if protocol == "http" else server.options.grpc_port

    async def main():
        async with AsyncPrismClient(f"localhost:{port}", protocol) as client:
            good = await asyncio.gather(*[client.decide(SAMPLE_TICKET, [t]) for t in ("team", "severity@1")])
            with pytest.raises(PrismError, match="unknown task"):
                await client.decide(SAMPLE_TICKET, ["nope"])
            return good

    (team,), (severity,) = asyncio.run(main())
    sync = http_client(server).decide(SAMPLE_TICKET, ["team", "severity@1"])
    assert (team.task, severity.task) == ("team", "severity")
    assert team.label == sync[0].label and severity.label == sync[1].label


def test_perf_analyzer_runs_against_the_ensemble(server):
    """The real perf_analyzer binary from .venv, with the committed input-data file."""
    from run_perf import CONFIGS, run_perf

    result = run_perf(f"localhost:{server.options.http_port}", CONFIGS / "unshared.json", concurrency=1, request_count=6)
    assert result["throughput"] > 0 and 0 < result["p50_ms"] <= result["p99_ms"]


def test_the_models_run_in_the_model_environment(server):
    """Every step's stub has the launcher's model environment (the tokenizer's threads, MKL's
    reproducible sgemm, glibc's arena limit): Triton starts the stubs with the server's."""
    for model in ("prism_tokenizer", "prism_decision", "prism_postprocess"):
        pids = processes_with(f"{model}/1/model.py".encode())
        assert pids, model
        for pid in pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environment = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            for name, value in MODEL_ENVIRONMENT.items():
                assert environment.get(name.encode()) == value.encode(), (model, name)
