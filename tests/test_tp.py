"""Tensor parallelism (gloo on CPU): bit-identical to TP = 1, sharded loading, worker lifecycle."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from prism_backend.config import ConfigError, EngineConfig
from prism_backend.errors import EngineUnavailable
from prism_backend.serving.pipeline import DecisionPipeline
from prism_client.client import PrismClient, PrismError
from prism_launcher.security import ADMIN_HEADER
from prism_launcher.server import ServerOptions, TritonServer

from helpers import REGISTRY, SAMPLE_TICKET, free_port, processes_with, wait_for

BATCH = [{"material": SAMPLE_TICKET, "tasks": ["team", "severity", "reply_time"]},
         {"material": "The mobile app logs me out every few minutes.", "tasks": ["severity@1"]},
         {"material": SAMPLE_TICKET, "tasks": ["severity@1"], "system": "Answer with one letter."}]

TP_ADMIN_TOKEN = "tensor-parallel-test-token"


def bits(results) -> list[bytes]:
    return [np.array(list(d["probabilities"].values()), np.float32).tobytes() for r in results for d in r]


def tp_workers() -> list[int]:
    """Live tensor-parallel worker processes on this machine."""
    return processes_with(b"prism_backend.engine.tp_worker")


def test_tp2_is_bit_identical_to_tp1_for_the_embedded_model(int8_pipeline):
    """TP = 2 (3 KV heads on 2 ranks: 1 + 2) with chunked prefill and the prefix cache on every
    rank, against TP = 1 without either: the same bits, cold and from the cache."""
    config = int8_pipeline.engine.config.replace(tp_size=2, prefill_chunk_tokens=128, prefix_cache_bytes=1 << 28)
    tp2 = DecisionPipeline(config, REGISTRY)
    try:
        assert len(tp2.engine.workers.pids) == 1
        assert tp2.engine.runner.model.spec.num_kv_heads == 1  # rank 0 of 1 + 2
        single, _ = int8_pipeline.decide_many(BATCH)
        cold, cold_stats = tp2.decide_many(BATCH)
        warm, warm_stats = tp2.decide_many(BATCH)
        assert cold_stats.chunks > 1 and warm_stats.tokens_cached > 0
        assert bits(cold) == bits(single) == bits(warm)
    finally:
        tp2.engine.close()
    assert wait_for(lambda: not tp_workers(), 20)


@pytest.mark.parametrize("precision, plan", [("int8", None), ("int8", "qkv,down:1+2"), ("fp32", None)])
def test_tp2_on_a_tiny_qwen3(tiny_model_dir, precision, plan):
    """plan: a precision plan whose row-parallel down_proj has its own passes (8-bit activations: the
    ranks all-reduce its row maxima and exact integer sums as for any width)."""
    config = EngineConfig(model_dir=tiny_model_dir("qwen3"), precision=precision, prefix_cache_bytes=0,
                          **({} if plan is None else {"keep_exact": plan}))
    batch = BATCH[:2]
    single, _ = DecisionPipeline(config, REGISTRY).decide_many(batch)
    tp2 = DecisionPipeline(config.replace(tp_size=2), REGISTRY)
    try:
        if plan is not None:  # rank 0's row-parallel down_proj in the plan's own passes
            assert {(p.down.act_passes, p.down.weight_passes, p.down.group is not None)
                    for p in tp2.engine.runner.model.proj} == {(1, 2, True)}
        split, _ = tp2.decide_many(batch)
    finally:
        tp2.engine.close()
    if precision == "int8":  # exact int32 all-reduce: the same bits
        assert bits(split) == bits(single)
    else:  # fp32 partial sums are added in another order: the same numbers to rounding
        a = np.frombuffer(b"".join(bits(split)), np.float32)
        b = np.frombuffer(b"".join(bits(single)), np.float32)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_more_ranks_than_kv_heads_is_rejected(tiny_model_dir):
    config = EngineConfig(model_dir=tiny_model_dir("qwen3"), precision="int8", tp_size=3)  # 2 KV heads
    with pytest.raises(ConfigError, match="tp_size 3 is larger than the model's 2 KV heads"):
        DecisionPipeline(config, REGISTRY)
    assert wait_for(lambda: not tp_workers(), 20)


def test_a_dead_worker_fails_requests_fast(tiny_model_dir):
    tp2 = DecisionPipeline(EngineConfig(model_dir=tiny_model_dir("qwen3"), precision="int8", tp_size=2), REGISTRY)
    try:
        (worker,) = tp2.engine.workers.pids
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: tp2.engine.workers.failure is not None, 10)
        start = time.monotonic()
        with pytest.raises(EngineUnavailable, match=f"worker rank 1 \\(pid {worker}\\) exited"):
            tp2.decide_many(BATCH[:1])
        assert time.monotonic() - start < 5
    finally:
        tp2.engine.close()


@pytest.mark.server
def test_server_tp2_with_two_instances(model_dir, int8_pipeline):
    """--instances 2 --tp 2 through a real server: TP = 1 bits, workers gone after an unload and
    after shutdown, a killed worker turns requests into a clear UNAVAILABLE error."""
    assert not tp_workers()
    options = ServerOptions(precision="int8", instances=2, tp=2, http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_dir=model_dir, model_control_explicit=True,
                            admin_token=TP_ADMIN_TOKEN)
    expected, _ = int8_pipeline.decide_many(BATCH[:1])
    with TritonServer(options) as server:
        url = f"localhost:{options.http_port}"
        assert len(tp_workers()) == 2  # one worker per instance
        got = PrismClient(url).decide(SAMPLE_TICKET, BATCH[0]["tasks"])
        assert [d.probability_array().tobytes() for d in got] == bits(expected)

        admin = httpclient.InferenceServerClient(url, network_timeout=600)  # an int8 load can take minutes on 2 busy cores
        for name in ("prism", "prism_decision"):
            admin.unload_model(name, headers={ADMIN_HEADER: TP_ADMIN_TOKEN})  # Triton restricts it to the token
        assert wait_for(lambda: not tp_workers(), 60), tp_workers()
        for name in ("prism_decision", "prism"):
            admin.load_model(name, headers={ADMIN_HEADER: TP_ADMIN_TOKEN})
        workers = tp_workers()
        assert len(workers) == 2

        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        with pytest.raises(PrismError) as info:
            PrismClient(url).decide(SAMPLE_TICKET, ["team"])
        assert "tensor-parallel worker rank 1" in info.value.message and "reload the model" in info.value.message
    assert not tp_workers()
