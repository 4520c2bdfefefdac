"""Shared fixtures: the embedded model, tiny random checkpoints of every architecture, a real server."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton-lang kernels run through Triton's interpreter. Triton picks the
    # interpreter when a kernel is defined, so this must precede any import of kernels/.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import zlib
from pathlib import Path

import pytest

from prism_backend.config import EngineConfig
from prism_backend.paths import DEFAULT_MODEL_DIR
from prism_backend.text.tokenizer import TOKENIZER_FILES
from prism_launcher.server import ServerOptions, TritonServer
from helpers import REGISTRY, free_port


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from prism_launcher.embedded_model import ensure_embedded_model

    return ensure_embedded_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def fp32_config(model_dir) -> EngineConfig:
    # no prefix cache: tests that count computed tokens must not depend on what ran before them
    return EngineConfig(model_dir=model_dir, precision="fp32", prefix_cache_bytes=0)


@pytest.fixture(scope="session")
def pipeline(fp32_config):
    from prism_backend.serving.pipeline import DecisionPipeline

    return DecisionPipeline(fp32_config, REGISTRY)


@pytest.fixture(scope="session")
def int8_pipeline(fp32_config):
    from prism_backend.serving.pipeline import DecisionPipeline

    return DecisionPipeline(fp32_config.replace(precision="int8"), REGISTRY)


@pytest.fixture(scope="session")
def hf_reference(model_dir):
    from prism_launcher.reference import HFReference

    return HFReference(model_dir)


def _tiny_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.15, rms_norm_eps=1e-6)
    if arch == "llama3":  # Llama-3 style RoPE scaling, untied head
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    if arch == "llama_tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2":  # q/k/v bias
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "qwen3":  # q/k RMSNorm, explicit head_dim
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir):
    """Factory: a random checkpoint of `arch`, built offline, with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            # seeded by the architecture, not by how many came before: a test gets the same
            # weights whether it runs alone or after others (a tolerance measured alone holds in the suite)
            torch.manual_seed(zlib.crc32(arch.encode()))
            vocab = 49152  # SmolLM2's tokenizer
            model = AutoModelForCausalLM.from_config(_tiny_config(arch, vocab), dtype=torch.float32)
            if getattr(model.config, "attention_bias", False) or arch == "qwen2":
                with torch.no_grad():  # non-zero biases, so a dropped bias would show
                    for layer in model.model.layers:
                        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                            proj.bias.normal_(0, 0.5)
            model.save_pretrained(out, safe_serialization=True)
            for name in TOKENIZER_FILES:
                if (model_dir / name).exists():
                    shutil.copy(model_dir / name, out / name)
            made[arch] = out
        return made[arch]

    return make





@pytest.fixture(scope="session")
def server(model_dir):
    # fp32 without the prefix cache: these tests compare bits across calls, and fp32 (unlike int8) is
    # not invariant to how many rows a pass computes; the int8 servers test the cache
    options = ServerOptions(precision="fp32", http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), model_dir=model_dir,
                            # gather_ms: a test's concurrent callers reach the decision step a few
                            # ms apart; 100 ms gathers them into one batch even on loaded CI cores
                            extra_parameters={"prefix_cache_bytes": "0", "gather_ms": "100"},
                            # functional tests queue a few concurrent requests: on busy cores they must
                            # not meet the overload policy's timeout (tests/test_security.py tests it)
                            max_queue_wait_s=600)
    srv = TritonServer(options)
    srv.start()
    yield srv
    srv.stop()


# Fixtures that start a real tritonserver or `prism serve`: a test using one is marked `server`
# (tests that start one themselves carry the mark explicitly).
SERVER_FIXTURES = {"server", "int8_server", "front", "cluster", "exported", "bare_server"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


def pytest_terminal_summary(terminalreporter):
    """One line saying which CPU kind the run covered and which ISA-specific tests it skipped."""
    from collections import Counter

    from helpers import ISA_SKIP
    from kernels.cpu.features import machine

    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if ISA_SKIP in reason:
            reasons[reason.removeprefix("Skipped: ")] += 1
    skipped = "; ".join(f"{n} x {why}" for why, n in reasons.items()) or "none"
    terminalreporter.write_line(f"CPU kind: {machine()}; ISA-specific tests skipped: {skipped}")
