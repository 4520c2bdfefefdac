"""Configuration validation, the config.pbtxt rendering of the launcher, and the CLI's flags."""
import os
import socket
import subprocess
import sys

import pytest

from prism_backend import processes
from prism_backend.config import ConfigError, EngineConfig
from prism_launcher.server import (
    MODEL_REPOSITORY, ServerOptions, log_summary, render_model_repository, set_instance_count,
    set_parameter,
)

from helpers import free_port


def test_config_from_triton_parameters(tmp_path):
    cfg = EngineConfig.from_parameters({"model_dir": "weights", "max_candidates": "8", "weight_passes": "1"},
                                       base_dir=tmp_path)
    assert cfg.model_dir == (tmp_path / "weights").resolve()
    assert cfg.max_candidates == 8 and cfg.weight_passes == 1
    # tree attention's arithmetic: auto is integers under int8, float32 under exact and fp32
    assert cfg.compute.integer_attention
    assert not EngineConfig.from_parameters({"model_dir": "m", "precision": "exact"}).compute.integer_attention
    assert not EngineConfig.from_parameters({"model_dir": "m", "precision": "fp32"}).compute.integer_attention
    assert not EngineConfig.from_parameters({"model_dir": "m", "attention": "float"}).compute.integer_attention
    assert EngineConfig.from_parameters({"model_dir": "m", "precision": "fp32", "attention": "integer"}).compute.integer_attention


@pytest.mark.parametrize("params, message", [
    ({"model_dir": "m", "precision": "fp16"}, "precision must be one of"),
    ({"model_dir": "m", "max_candidates": "many"}, r"must be a number \(int\)"),
    ({"model_dir": "m", "smooth_alpha": "1.5"}, r"smooth_alpha must be in \[0, 1\)"),
    ({"model_dir": "m", "weight_passes": "3"}, "weight_passes must be 1 or 2"),
    ({"model_dir": "m", "attention": "int4"}, "attention must be one of"),
    ({"model_dir": "m", "max_candidates": "1"}, "between 2 and 26"),
    ({"model_dir": "m", "colour": "red"}, "unknown parameter"),
    ({"model_dir": "${model_dir}"}, "unfilled template"),
    ({}, "'model_dir' is required"),
])
def test_config_errors_say_what_to_change(params, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_parameters(params)


def test_render_fills_parameters(tmp_path, model_dir):
    options = ServerOptions(instances=3, model_dir=model_dir, extra_parameters={"max_candidates": "12"})
    repo = render_model_repository(options, tmp_path / "repo")
    text = (repo / "prism_decision" / "config.pbtxt").read_text()
    assert "count: 3" in text and f'string_value: "{model_dir.resolve()}"' in text
    assert 'key: "max_candidates" value: { string_value: "12" }' in text
    threads = max(1, len(os.sched_getaffinity(0)) // 3)  # the cores shared among the instances
    assert f'key: "num_threads" value: {{ string_value: "{threads}" }}' in text
    assert (repo / "prism_tokenizer" / "1" / "tasks.json").exists()
    # the checked-in repository is left as it was
    assert "count: 1" in (MODEL_REPOSITORY / "prism_decision" / "config.pbtxt").read_text()


def test_render_sets_max_batch_size_and_the_queue_bound(tmp_path, model_dir):
    """Triton's batcher stays plain (no priority levels or queue policy: they stop its prefetch);
    the queue bound is the scheduler's max_queue_wait_s."""
    repo = render_model_repository(ServerOptions(model_dir=model_dir, max_batch_size=5, max_queue_wait_s=2.5),
                                   tmp_path / "repo")
    text = (repo / "prism_decision" / "config.pbtxt").read_text()
    assert "\nmax_batch_size: 5\n" in text and "priority_levels" not in text and "queue_policy" not in text
    assert 'key: "max_queue_wait_s" value: { string_value: "2.5" }' in text
    with pytest.raises(ConfigError, match="max-queue-wait-s"):
        ServerOptions(model_dir=model_dir, max_queue_wait_s=0).validate()
    shipped = render_model_repository(ServerOptions(model_dir=model_dir), tmp_path / "repo2")
    assert "\nmax_batch_size: 8\n" in (shipped / "prism_decision" / "config.pbtxt").read_text()
    with pytest.raises(ConfigError, match="max-batch-size"):
        ServerOptions(model_dir=model_dir, max_batch_size=0).validate()
    with pytest.raises(ConfigError, match="servers_on_machine"):
        ServerOptions(model_dir=model_dir, servers_on_machine=0).validate()


def test_set_parameter_replaces_or_adds_known_keys_only():
    """config.pbtxt carries only overrides: a known key is replaced or added, an unknown one refused."""
    text = 'name: "x"\nparameters { key: "max_candidates" value: { string_value: "8" } }\n'
    assert set_parameter(text, "max_candidates", "12").count('string_value: "12"') == 1
    added = set_parameter(text, "prefix_cache_bytes", "0")
    assert 'parameters { key: "prefix_cache_bytes" value: { string_value: "0" } }' in added
    assert set_parameter(added, "prefix_cache_bytes", "5").count("prefix_cache_bytes") == 1
    with pytest.raises(ConfigError, match="unknown parameter 'nope'"):
        set_parameter(text, "nope", "2")


def test_the_repository_writes_no_default_twice():
    """The shipped config.pbtxt files set only model_dir; every default lives in config.py."""
    import re

    for name in ("prism_tokenizer", "prism_decision"):
        keys = re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"', (MODEL_REPOSITORY / name / "config.pbtxt").read_text())
        assert keys == ["model_dir"], (name, keys)
    with pytest.raises(ConfigError, match="instance_group"):
        set_instance_count("name: 'x'", 2)


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp16"], "invalid choice"),
    (["--instances", "0"], "must be >= 1"),
    (["--tp", "0"], "must be >= 1"),
    (["--model-dir", "/nonexistent"], "holds no Hugging Face checkpoint"),
    (["--http-port", "9000", "--grpc-port", "9000"], "must differ"),
])
def test_serve_rejects_unsupported_flags(args, message, model_dir):
    done = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr


def test_log_summary_puts_the_errors_before_the_tail():
    log = ["I1205 22:20:30 1 model_lifecycle.cc:472] \"loading: prism_decision:1\"",
           "E1205 22:20:34 1 model_lifecycle.cc:641] \"failed to load 'prism_decision' version 1: Internal: boom\"",
           "| prism_decision    | 1       | UNAVAILABLE: Internal: boom |",
           *[f"| option {i} | value |" for i in range(60)]]
    summary = log_summary("\n".join(log), tail_lines=5)
    errors, tail = summary.split("last log lines:")
    assert "failed to load 'prism_decision' version 1: Internal: boom" in errors and "UNAVAILABLE" in errors
    assert "loading:" not in summary and tail.strip().splitlines() == log[-5:]
    assert log_summary("I1205 fine\nI1205 done", 5).startswith("last log lines:")  # no errors: the tail alone


@pytest.mark.server
def test_serve_says_which_model_could_not_load_and_why(tmp_path, model_dir):
    """`prism serve` on a checkpoint with truncated weights: a real tritonserver exits while loading;
    the command ends with 1 and names the model and the loader's reason (the log's error lines),
    not only the option table that ends Triton's log, and no traceback."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for source in model_dir.iterdir():
        if source.is_file() and source.name != "model.safetensors":
            (broken / source.name).write_bytes(source.read_bytes())
    (broken / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:4096])
    ports = [str(free_port()) for _ in range(3)]
    done = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "serve", "--model-dir", str(broken),
                           "--precision", "fp32", "--http-port", ports[0], "--grpc-port", ports[1],
                           "--metrics-port", ports[2]], capture_output=True, text=True, timeout=300)
    errors = done.stderr.split("last log lines:")[0]
    assert done.returncode == 1, done.stderr
    assert "prism: the server did not start: tritonserver exited with code" in errors, done.stderr
    assert "failed to load 'prism_decision'" in errors and "SafetensorError" in errors, done.stderr
    assert "Traceback (most recent call last)" not in done.stderr.split("errors in the log:")[0]


def test_free_ports_lie_below_the_ephemeral_range_each_once(monkeypatch):
    """Servers started on "any free port" (the launcher's replicas, the router, the tests' servers) get a
    port no outgoing connection can take before they bind it -- one below the kernel's ephemeral range --
    never the same one twice in a process, and never one that something already holds."""
    low, _ = processes.ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(processes.LISTEN_PORTS_FROM <= port < low for port in ports)
    size = low - processes.LISTEN_PORTS_FROM
    with socket.socket() as held:  # a port in use is passed over: the walk goes on to the next free one
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        monkeypatch.setattr(processes, "_next_port", [ports[0] - processes.LISTEN_PORTS_FROM])
        after = free_port()
        assert after != ports[0] and 0 < (after - ports[0]) % size < 256
