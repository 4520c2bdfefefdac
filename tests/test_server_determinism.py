"""Through real servers (int8, 1 and 2 instances): identical float32 bytes alone, batched by Triton
at concurrency 1, 4 and 8, on any instance, and equal to the in-process engine."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from prism_backend.reproducibility import torch_threads
from prism_backend.serving.pipeline import DecisionPipeline
from prism_client.client import PrismClient
from prism_client.determinism import CHECK_REQUESTS, digest
from prism_launcher.server import ServerOptions, TritonServer

from helpers import GOLDEN_DECISIONS_PATH, REGISTRY, REPO_ROOT, free_port
from helpers import metric, scrape


@pytest.fixture(scope="module", params=[1, 2], ids=["1-instance", "2-instances"])
def int8_server(request, model_dir):
    # batches of up to 8 (the shipped default is 2): concurrency 4 and 8 then vary the batch size
    options = ServerOptions(precision="int8", instances=request.param, http_port=free_port(),
                            grpc_port=free_port(), metrics_port=free_port(), model_dir=model_dir,
                            max_batch_size=8)
    with TritonServer(options) as server:
        yield server


def test_determinism_check_command(int8_server):
    done = subprocess.run(
        [sys.executable, "-m", "prism_client", "determinism-check",
         "--url", f"localhost:{int8_server.options.http_port}", "--rounds", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "concurrency 8, shuffled" in done.stdout and "determinism: bit-identical" in done.stdout


def _determinism_check(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prism_client", "determinism-check", "--url",
                           f"localhost:{server.options.http_port}", "--rounds", "1", *args],
                          capture_output=True, text=True, timeout=600)


def test_a_recording_replays_here_and_holds_the_golden_bits(int8_server, tmp_path):
    """--save records what this server answers; those are the committed golden bits (the same on
    every x86-64 CPU, test_replay.py); --replay of them passes, of a changed one fails."""
    recording = tmp_path / "recorded.json"
    done = _determinism_check(int8_server, "--save", str(recording))
    assert done.returncode == 0, done.stdout + done.stderr
    golden = json.loads(GOLDEN_DECISIONS_PATH.read_text())["int8"]
    assert json.loads(recording.read_text())["digests"] == golden

    elsewhere = tmp_path / "golden.json"
    elsewhere.write_text(json.dumps({"digests": golden}))
    done = _determinism_check(int8_server, "--replay", str(elsewhere))
    assert done.returncode == 0 and "against the recording" in done.stdout, done.stdout + done.stderr

    elsewhere.write_text(json.dumps({"digests": golden[:-1] + ["0" * 64]}))
    done = _determinism_check(int8_server, "--replay", str(elsewhere))
    assert done.returncode == 1 and "determinism: MISMATCH" in done.stdout, done.stdout + done.stderr
    assert re.search(r"against the recording\s+5 requests\s+1 mismatches", done.stdout), done.stdout

    elsewhere.write_text(json.dumps({"digests": []}))
    done = _determinism_check(int8_server, "--replay", str(elsewhere))
    assert done.returncode == 2 and "written by --save" in done.stderr, done.stdout + done.stderr


def test_server_bits_equal_in_process_engine(int8_server, int8_pipeline_bits):
    client = PrismClient(f"localhost:{int8_server.options.grpc_port}", "grpc")
    remote = [digest([d.probability_array() for d in client.decide(r["material"], r["tasks"])])
              for r in CHECK_REQUESTS]
    assert remote == int8_pipeline_bits


def test_startup_self_check_logged(int8_server):
    assert "determinism self-check: bit-identical across batchings, cache state and thread counts" in \
        int8_server.log_path.read_text()


def _twelve_tickets() -> list[dict]:
    """12 shipped eval tickets x 3 tasks, one of them inline: 36 decisions."""
    with open(REPO_ROOT / "evals" / "data" / "tickets.jsonl", encoding="utf-8") as f:
        materials = [json.loads(line)["material"] for _, line in zip(range(12), f)]
    return [{"material": m, "tasks": ["team", "severity", CHECK_REQUESTS[1]["tasks"][1]]} for m in materials]


@pytest.fixture(scope="module")
def three_thread_bits(int8_pipeline):
    """The in-process engine at 3 threads: a count neither server runs with on 2 cores."""
    with torch_threads(3):
        results, _ = int8_pipeline.decide_many(_twelve_tickets())
    return [digest([np.array(list(d["probabilities"].values()), np.float32) for d in r]) for r in results]


_SERVED_BITS: dict[int, list[str]] = {}


def test_http_bits_do_not_depend_on_instances_or_threads(int8_server, three_thread_bits):
    """One instance runs on every core (2 threads here), two instances share them (1 thread each):
    the same requests over HTTP, one at a time, give the same float32 bytes from both servers and
    from the in-process engine at 3 threads."""
    client = PrismClient(f"localhost:{int8_server.options.http_port}")
    served = [digest([d.probability_array() for d in client.decide(r["material"], r["tasks"])])
              for r in _twelve_tickets()]
    assert served == three_thread_bits
    _SERVED_BITS[int8_server.options.instances] = served
    assert all(bits == served for bits in _SERVED_BITS.values())


@pytest.fixture(scope="module")
def int8_pipeline_bits(fp32_config):
    pipeline = DecisionPipeline(fp32_config.replace(precision="int8"), REGISTRY)
    results, _ = pipeline.decide_many(CHECK_REQUESTS)
    return [digest([np.array(list(d["probabilities"].values()), np.float32) for d in r]) for r in results]


def test_self_check_metric_is_one(int8_server):
    values = scrape(int8_server)
    instances = int8_server.options.instances
    assert metric(values, "prism_determinism_self_check") == instances  # 1 per instance


def test_prefix_cache_serves_a_seen_ticket(int8_server):
    """Questions about a ticket the server has seen reuse its cached blocks, with the same bits.
    q1, q2, q2: with two instances the second q2 finds the ticket cached wherever it lands."""
    client = PrismClient(f"localhost:{int8_server.options.http_port}")
    material = "Prefix cache check: the CSV export drops the last column of every report. " * 12
    before = scrape(int8_server)
    client.decide(material, ["team"])
    answers = [client.decide(material, ["severity"])[0].probability_array().tobytes() for _ in range(2)]
    after = scrape(int8_server)
    reused = metric(after, "prism_prefix_cache_tokens_reused_total") - metric(before, "prism_prefix_cache_tokens_reused_total")
    assert reused >= 64 * 2  # at least the system prompt and the material's full blocks
    assert answers[0] == answers[1]
    for name in ("prism_prefix_cache_bytes", "prism_prefix_cache_hit_rate"):
        assert metric(after, name) > 0, name
    assert any(k.startswith("prism_prefix_cache_evictions_total") for k in after)
