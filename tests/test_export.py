"""`prism export-repository`: the folder alone serves Prism on a bare Triton, as a fleet would load it.

The exported repository is moved, then served by the bundled tritonserver started with an empty
environment (only the server binary's own libraries), from another working directory, with the
wheel's Python backend as is (it carries no stub). It must answer exactly like `prism serve`.
"""
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kernels.cpu.features import AVX2_ENVIRONMENT
from prism_backend.engine.calibration import SHIPPED, SHIPPED_MANIFEST
from prism_client.client import PrismClient, PrismError
from prism_client.determinism import CHECK_REQUESTS, digest
from prism_launcher.export import ENV_ARCHIVE, ENV_DIRECTORY, LIBRARY_FOLDER, MANIFEST, PARAMETER, export_repository
from prism_launcher.server import REPO_ROOT, log_summary, triton_install, wait_until_serving

from helpers import GOLDEN_DECISIONS_PATH, SAMPLE_TICKET, free_port

TASKS = ["team", "reply_time", "severity@1", '{"question": "Is the customer angry?", "options": ["Yes", "No"]}']
MATERIALS = [SAMPLE_TICKET, "My invoice is wrong and nobody answers my emails."]


def served_parameters(server) -> dict[str, str]:
    """prism_decision's parameters as `prism serve` rendered them for the running server."""
    text = (server.workdir / "model_repository" / "prism_decision" / "config.pbtxt").read_text()
    return dict(PARAMETER.findall(text))


def container_like_backends(paths: dict[str, Path], target: Path) -> Path:
    """backends/python as NVIDIA's 24.10 container has it: the backend with a stub for the container's
    Python, 3.10, not the 3.11 of the exported environment (the backend refuses to start without a
    stub of its own; the models must bring theirs)."""
    python = target / "python"
    python.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (python / name).symlink_to(paths["backend"] / name)
    (python / "triton_python_backend_stub").symlink_to(paths["stub"].parent.parent / "3.10" / paths["stub"].name)
    return target


class BareTriton:
    """tritonserver with nothing from Prism around it: `env -i`, no PYTHONPATH, another cwd."""

    def __init__(self, repository: Path, cwd: Path, environment: tuple[str, ...] = ()):
        """environment: more NAME=VALUE for the server's otherwise empty environment."""
        paths = triton_install()
        self.http_port, self.grpc_port, metrics_port = free_port(), free_port(), free_port()
        self.log = cwd / "tritonserver.log"
        # The machine kind is not Prism's environment: a run that forces the AVX2 path (the switches of
        # kernels/cpu/features.py) forces it on the bare server too, or its float steps would take
        # the native path and give the other kind's bits.
        machine_kind = [f"{k}={os.environ[k]}" for k in AVX2_ENVIRONMENT if os.environ.get(k)]
        command = [
            "env", "-i", f"LD_LIBRARY_PATH={paths['libs']}",  # the server binary's own libraries
            *machine_kind, *environment,
            str(paths["server"]), f"--model-repository={repository}",
            f"--backend-directory={container_like_backends(paths, cwd / 'backends')}",
            f"--cache-directory={paths['caches']}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={metrics_port}",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_ready(self, timeout: float = 420.0) -> None:
        ready = wait_until_serving(self.process, self.http_port, "/v2/health/ready", timeout, 1.0,
                                   lambda code: f"tritonserver exited with {code}; {self.report()}")
        assert ready, f"not ready after {timeout} s; {self.report()}"

    def report(self) -> str:
        """The log's errors and tail, and the room the load needed: the Python backend unpacks the
        environment (~2.2 GB) into /tmp and gives each stub a region in /dev/shm."""
        free = {folder: shutil.disk_usage(folder).free / 2**20 for folder in ("/tmp", "/dev/shm") if os.path.isdir(folder)}
        room = ", ".join(f"{folder} {mib:.0f} MiB" for folder, mib in free.items())
        return f"free space now: {room}\n{log_summary(self.log.read_text())}"

    def stop(self) -> None:
        """SIGINT: Triton unloads the models and deletes the environment it extracted to /tmp
        (2.2 GB: give it time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(240)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="module")
def exported(server, tmp_path_factory):
    """Exported with the very parameters the `server` fixture runs with, then moved elsewhere."""
    parameters = {k: v for k, v in served_parameters(server).items() if k != "model_dir"}
    options = dataclasses.replace(server.options, extra_parameters=parameters)
    first = export_repository(options, tmp_path_factory.mktemp("export") / "repository")
    moved = tmp_path_factory.mktemp("model-store") / "prism"
    first.rename(moved)
    return moved


@pytest.fixture(scope="module")
def bare_server(exported, tmp_path_factory):
    triton = BareTriton(exported, tmp_path_factory.mktemp("elsewhere"))
    try:
        triton.wait_ready()
        yield triton
    finally:
        triton.stop()


def probability_bytes(url: str, protocol: str) -> list[list[bytes]]:
    with PrismClient(url, protocol) as client:  # closed: a server's stop waits for open connections
        return [[d.probability_array().tobytes() for d in client.decide(m, TASKS)] for m in MATERIALS]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_exported_repository_answers_like_prism_serve(server, bare_server, protocol):
    port = {"http": "http_port", "grpc": "grpc_port"}[protocol]
    served = probability_bytes(f"localhost:{getattr(server.options, port)}", protocol)
    exported = probability_bytes(f"localhost:{getattr(bare_server, port)}", protocol)
    assert exported == served


def test_exported_repository_rejects_bad_input_with_400(bare_server):
    with pytest.raises(PrismError) as info, PrismClient(f"localhost:{bare_server.http_port}", "http") as client:
        client.decide(SAMPLE_TICKET, ["team", "no_such_task"])
    assert info.value.status == "400" and "no_such_task" in info.value.message


def test_exported_repository_holds_no_path_of_this_checkout(exported):
    for path in [exported / MANIFEST, *exported.glob("*/config.pbtxt")]:
        assert str(REPO_ROOT) not in path.read_text(), path
    decision = (exported / "prism_decision" / "config.pbtxt").read_text()
    assert 'key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/../prism_env.tar.gz" }' in decision
    assert 'key: "model_dir" value: { string_value: "checkpoint" }' in decision


def test_exported_repository_carries_the_exact_gemm_library(exported):
    """Built here, so a server without g++ multiplies with it as `prism serve` does."""
    from kernels.cpu import exact_gemm

    for model in ("prism_decision", "prism_tokenizer", "prism_postprocess"):
        assert LIBRARY_FOLDER == Path("kernels", "cpu", "lib")
        assert (exported / model / LIBRARY_FOLDER / exact_gemm.library_name()).is_file(), model
        assert not list((exported / model / LIBRARY_FOLDER).glob(".*")), "a partial build was exported"


def tree_digest(root: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            digests[str(path.relative_to(root))] = h.hexdigest()
    return digests


INT8_FLAGS = ("--precision", "int8", "--instances", "2", "--parameter", "prefix_cache_bytes=0")


def export_through_cli(out: Path, *flags: str) -> Path:
    done = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "export-repository", str(out), *flags],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def int8_exports(exported, tmp_path_factory):
    """Two exports of the int8 default with the same flags, through the CLI (after `exported`, whose
    export built the environment archive both then take from the cache)."""
    return [export_through_cli(tmp_path_factory.mktemp("int8-export") / name, *INT8_FLAGS) for name in ("a", "b")]


def test_two_exports_are_identical(int8_exports):
    """Same checkout, same flags: the same bytes, file for file, the shipped calibration included
    (see docs/deploy.md for rebuilding the environment archive)."""
    a, b = (tree_digest(out) for out in int8_exports)
    assert a == b
    assert ENV_ARCHIVE in a and "prism_decision/checkpoint/model.safetensors" in a
    assert "prism_tokenizer/1/tasks.json" in a and "prism_postprocess/triton_python_backend_stub" in a
    shipped = f"prism_decision/checkpoint/{SHIPPED}"
    assert {f"{shipped}/{name}" for name in (SHIPPED_MANIFEST, "gptq.safetensors", "rows.safetensors")} <= set(a)
    assert json.loads((int8_exports[0] / MANIFEST).read_text())["checkpoint"]["sha256"][f"{SHIPPED}/gptq.safetensors"] \
        == a[f"{shipped}/gptq.safetensors"]
    decision = (int8_exports[0] / "prism_decision" / "config.pbtxt").read_text()
    assert "count: 2" in decision and 'key: "precision" value: { string_value: "int8" }' in decision


def check_request_digests(http_port: int) -> list[str]:
    """The digests of the fixed request set (CHECK_REQUESTS) as the server answers them: the golden
    int8 digests for a faithful server."""
    with PrismClient(f"localhost:{http_port}", "http") as client:
        return [digest([d.probability_array() for d in client.decide(r["material"], r["tasks"])])
                for r in CHECK_REQUESTS]


def stub_python_homes(server_pid: int) -> list[str]:
    """PYTHONHOME of each Python-backend stub the server started (the environment's `activate` sets
    it to the folder it runs from: the exported directory, or where the backend unpacked an archive)."""
    homes = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getsid(int(proc.name)) != server_pid:  # its own session
                continue
            if b"triton_python_backend_stub" not in (proc / "cmdline").read_bytes().split(b"\0")[0]:
                continue
            environ = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
            homes.append(environ.get(b"PYTHONHOME", b"").decode())
        except OSError:  # gone meanwhile
            continue
    return homes


@pytest.fixture(scope="module")
def directory_export(int8_exports, tmp_path_factory):
    """The int8 export's flags with the environment as a directory (after int8_exports: the same cache)."""
    return export_through_cli(tmp_path_factory.mktemp("directory-export") / "repository", *INT8_FLAGS,
                              "--environment", "directory")


def test_an_int8_export_starts_without_calibrating_or_unpacking_and_serves_the_golden_bits(directory_export, tmp_path):
    """A fleet's server: a bare Triton whose calibration cache is empty, on an export whose environment
    is a directory, loads the export's shipped calibration (it computes nothing, writes nothing to the
    cache, and its log says where the calibration came from), runs its stubs in that directory (no
    archive to unpack), finds at start the bits the exporter recorded, and answers the fixed request
    set with the committed golden bits."""
    out = directory_export
    assert not (out / ENV_ARCHIVE).exists() and (out / ENV_DIRECTORY / "bin" / "activate").is_file()
    assert json.loads((out / MANIFEST).read_text())["options"]["environment"] == "directory"
    for model in ("prism_tokenizer", "prism_decision", "prism_postprocess"):
        assert f'"$$TRITON_MODEL_DIRECTORY/../{ENV_DIRECTORY}"' in (out / model / "config.pbtxt").read_text()
    cache = tmp_path / "calibration-cache"
    triton = BareTriton(out, tmp_path, (f"PRISM_CALIBRATION_CACHE={cache}",))
    try:
        triton.wait_ready()
        homes = stub_python_homes(triton.process.pid)  # tokenizer, 2 decision instances, postprocess
        digests = check_request_digests(triton.http_port)
        log = triton.log.read_text()
    finally:
        triton.stop()
    assert len(homes) == 4 and {Path(home).resolve() for home in homes} == {(out / ENV_DIRECTORY).resolve()}
    assert digests == json.loads(GOLDEN_DECISIONS_PATH.read_text())["int8"]
    shipped = "calibration: GPTQ integers shipped with the checkpoint, rotated embedding and head shipped with the checkpoint"
    assert log.count(shipped) == 2, log_summary(log)  # both instances
    # each instance's startup self-check gave the bits the exporting process recorded
    assert log.count("thread counts, equal to the bits recorded at export") == 2, log_summary(log)
    recorded = json.loads((out / "prism_decision" / "checkpoint" / SHIPPED / SHIPPED_MANIFEST).read_text())
    assert len(recorded["exported_bits"]["digests"]) == 3 and recorded["exported_bits"]["config"]["precision"] == "int8"
    assert not cache.exists() or not list(cache.rglob("*.safetensors"))


def test_export_refuses_an_unknown_parameter(tmp_path):
    done = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "export-repository", str(tmp_path / "x"),
                           "--parameter", "no_such_knob=1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no_such_knob" in done.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.server
def test_prism_serve_takes_an_exported_repository_as_it_is(tmp_path):
    """`prism serve --repository DIR` starts tritonserver on DIR itself: nothing rendered, nothing copied."""
    from prism_launcher.server import ServerOptions, TritonServer

    (tmp_path / "repo" / "prism").mkdir(parents=True)
    (tmp_path / "repo" / "prism" / "config.pbtxt").write_text('name: "prism"\n')
    server = TritonServer(ServerOptions(repository=tmp_path / "repo"), workdir=tmp_path / "work")
    assert f"--model-repository={(tmp_path / 'repo').resolve()}" in server.command()
    # the configs are complete: no stub is started only to fill one in (the bare server above runs without it)
    assert "--disable-auto-complete-config" in server.command()
    assert not (tmp_path / "work" / "model_repository").exists()
    done = subprocess.run([sys.executable, "-m", "prism_launcher.cli", "serve", "--repository", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "holds no Prism model repository" in done.stderr


def test_a_server_on_the_avx2_path_serves_the_bits_recorded_on_this_machine(directory_export, tmp_path):
    """Another CPU kind in the fleet: the export recorded its bits on the path this process runs on (the
    native one, unless the whole suite is forced onto AVX2); a bare server forced onto the AVX2 path
    (kernels/cpu/features.py's AVX2_ENVIRONMENT: Prism's kernels, torch's dispatch, MKL's generic branch)
    checks itself against them at start and answers with the golden bits."""
    forced = tuple(f"{k}={v}" for k, v in AVX2_ENVIRONMENT.items())
    triton = BareTriton(directory_export, tmp_path, (*forced, f"PRISM_CALIBRATION_CACHE={tmp_path / 'cache'}"))
    try:
        triton.wait_ready()
        digests = check_request_digests(triton.http_port)
        log = triton.log.read_text()
    finally:
        triton.stop()
    assert log.count("thread counts, equal to the bits recorded at export") == 2, log_summary(log)
    routes = re.findall(r"exact-product routes: ([^;]*);", log)  # each instance's, e.g. "2+2 576x960 int16, ..."
    assert len(routes) == 2 and all("int16" in r and "vnni" not in r and "amx" not in r for r in routes), routes
    assert digests == json.loads(GOLDEN_DECISIONS_PATH.read_text())["int8"]
