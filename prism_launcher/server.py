"""Launch a real `tritonserver` on Prism's model repository, without Docker or a GPU.

The server binary, the Python backend and its stub come from the `nvidia-pytriton` wheel (Triton
Inference Server 2.51). Only this launcher knows that layout; `model_repository/` itself serves
unchanged from NVIDIA's Triton container. The launcher renders a copy of the repository with the
chosen parameters (precision, instances, model directory) filled into the config.pbtxt files.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from prism_backend.config import BACKEND_PARAMETERS, PRECISIONS, ConfigError, EngineConfig
from prism_backend.paths import DEFAULT_MODEL_DIR, MODEL_REPOSITORY, REPO_ROOT
from prism_backend.processes import die_with_parent
from prism_backend.reproducibility import MKL_CBWR_ENV

from .security import triton_restriction_flags, validate_admin_token

RUN_DIR = REPO_ROOT / ".run"
# What set_parameter may write: the engine's knobs, and what Triton's Python backend reads itself.
PARAMETER_KEYS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) | set(BACKEND_PARAMETERS)
STUB_DEATH_GRACE_S = 1.0  # a dead stub whose server exits within this was killed with it
READY_TIMEOUT_S = 300.0  # a cold start loads, quantises and self-checks the model in every instance
ENGINE_MODELS = ("prism_tokenizer", "prism_decision")  # the steps that read model_dir
# How `prism export-repository` writes the models' Python environment (export.py, ENV_DIRECTORY, says why)
EXPORT_ENVIRONMENTS = ("archive", "directory")
LOOPBACK = "127.0.0.1"
# Every config.pbtxt of the repository is complete, so Triton need not ask the Python backend to fill
# one in: with auto-completion on (Triton's default) the backend starts one more stub per model only
# to import its model.py and ask -- for prism_decision torch and the engine, 2-3 s of every start
# (docs/deploy.md).
NO_AUTO_COMPLETE = "--disable-auto-complete-config"
# Where the Python backend keeps each stub's shared-memory region (1 MB and up; POSIX shm_open)
SHARED_MEMORY_DIR = Path("/dev/shm")
# Environment of the models' processes, whoever starts them: server_environment here, the
# execution environment's bin/activate in an exported repository (prism_launcher/execution_env.py).
MODEL_ENVIRONMENT = {
    # the tokenizer step encodes a request's prompts in one parallel call (text/tokenizer.py
    # encode_many); Triton starts the stubs by exec, so no fork follows the tokenizer's threads
    "TOKENIZERS_PARALLELISM": "true",
    "MKL_CBWR": MKL_CBWR_ENV,  # thread-count-invariant sgemm from the start (prism_backend/reproducibility.py)
    # glibc gives each thread that allocates under contention an arena of its own, and each keeps
    # what a batch freed: ~10 arenas of 25-52 MiB in the decision stub after the side by side's load.
    # Two: one replica 1.14-1.20 GiB after that load in four runs against 1.22-1.23 in three,
    # requests/s at 1 / 4 / 8 callers unchanged (docs/results.md, "Memory of one replica")
    "MALLOC_ARENA_MAX": "2",
}


@dataclass
class ServerOptions:
    precision: str = "int8"
    instances: int = 1
    tp: int = 1
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    model_dir: Path = DEFAULT_MODEL_DIR
    extra_parameters: dict[str, str] = field(default_factory=dict)  # prism_decision parameters
    model_control_explicit: bool = False
    max_batch_size: int | None = None  # prism_decision's; None keeps config.pbtxt's
    servers_on_machine: int = 1  # replicas sharing these cores (prism_launcher/cluster.py), for the thread share
    admin_token: str | None = None  # Triton's admin APIs need it (security.py); None: closed to all
    max_queue_wait_s: float | None = None  # prism_decision's admission bound; None keeps config.py's default
    # An exported repository (prism_launcher/export.py) to serve as it is, instead of rendering model_repository/
    repository: Path | None = None

    def validate(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.instances < 1:
            raise ConfigError(f"--instances must be >= 1, got {self.instances}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.servers_on_machine < 1:
            raise ConfigError(f"servers_on_machine must be >= 1, got {self.servers_on_machine}")
        if self.tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {self.tp}")
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        if len(set(ports)) != 3:
            raise ConfigError(f"HTTP, gRPC and metrics ports must differ, got {ports}")
        validate_admin_token(self.admin_token)
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ConfigError(f"--max-queue-wait-s must be > 0, got {self.max_queue_wait_s}")
        if self.repository is not None:
            if not (Path(self.repository) / "prism" / "config.pbtxt").exists():
                raise ConfigError(f"--repository {self.repository} holds no Prism model repository (prism/config.pbtxt)")
        elif not (Path(self.model_dir) / "config.json").exists():
            raise ConfigError(f"--model-dir {self.model_dir} holds no Hugging Face checkpoint (config.json)")


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Set a `parameters { key: ... }` entry of a config.pbtxt: replace its value, or add the entry.
    config.pbtxt carries only what a deployment overrides (prism_backend/config.py holds every
    default), so most keys are added here. Only keys the engine knows (EngineConfig) may be set."""
    if key not in PARAMETER_KEYS:
        raise ConfigError(f"unknown parameter {key!r}; known: {sorted(PARAMETER_KEYS)}")
    pattern = re.compile(r'(parameters\s*\{\s*key:\s*"%s"\s*value:\s*\{\s*string_value:\s*")[^"]*(")' % re.escape(key))
    new_text, count = pattern.subn(lambda m: m.group(1) + value + m.group(2), config_text)
    if count > 1:
        raise ConfigError(f"config.pbtxt has {count} parameter entries for {key!r}; expected at most 1")
    if count == 0:
        new_text = config_text.rstrip("\n") + f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    return new_text


def set_instance_count(config_text: str, count: int) -> str:
    new_text, n = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", lambda m: m.group(1) + str(count), config_text)
    if n != 1:
        raise ConfigError("config.pbtxt must have exactly one instance_group with a count")
    return new_text


def usable_cpus() -> int:
    """Cores this process may run on (`taskset` narrows them), not the machine's total."""
    return len(os.sched_getaffinity(0))


def set_max_batch_size(config_text: str, size: int) -> str:
    new_text, n = re.subn(r"(?m)^(max_batch_size:\s*)\d+", lambda m: m.group(1) + str(size), config_text)
    if n != 1:
        raise ConfigError("config.pbtxt must have exactly one max_batch_size")
    return new_text


def render_model_repository(options: ServerOptions, target: Path) -> Path:
    """Copy model_repository/ to `target` with the options filled into its config.pbtxt files."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(MODEL_REPOSITORY, target, ignore=shutil.ignore_patterns("__pycache__"))
    model_dir = str(Path(options.model_dir).resolve())
    for name in ENGINE_MODELS:
        path = target / name / "config.pbtxt"
        text = set_parameter(path.read_text(), "model_dir", model_dir)
        if name == "prism_decision":
            text = set_parameter(text, "precision", options.precision)
            text = set_instance_count(text, options.instances)
            text = set_parameter(text, "tp_size", str(options.tp))
            if options.max_batch_size is not None:
                text = set_max_batch_size(text, options.max_batch_size)
            if options.max_queue_wait_s is not None:
                text = set_parameter(text, "max_queue_wait_s", f"{options.max_queue_wait_s:g}")
            # Replicas, instances and their TP workers share the cores: give each process its share
            # of threads, or their OpenMP pools oversubscribe the machine and everything slows down.
            processes = options.servers_on_machine * options.instances * options.tp
            threads = str(max(1, usable_cpus() // processes))
            text = set_parameter(text, "num_threads", options.extra_parameters.get("num_threads", threads))
            for key, value in options.extra_parameters.items():
                text = set_parameter(text, key, value)
        path.write_text(text)
    return target


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; run `make serve` or `make test` to set up")
    return Path(list(spec.submodule_search_locations)[0])


def triton_install() -> dict[str, Path]:
    """Where the nvidia-pytriton wheel keeps the server, the Python backend and its stub."""
    root = _package_dir("pytriton") / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = {
        "server": root / "bin" / "tritonserver",
        "backend": root / "backends" / "python",
        "stub": root / "python_backend_stubs" / version / "triton_python_backend_stub",
        "caches": root / "caches",
        "libs": root.parent.parent / "nvidia_pytriton.libs",
    }
    for name, path in paths.items():
        if not path.exists():
            raise FileNotFoundError(f"Triton {name} not found at {path}")
    return paths


def server_environment(paths: dict[str, Path]) -> dict[str, str]:
    env = dict(os.environ)
    # The stub imports this interpreter's packages when its bin/ comes first on PATH, and it must
    # link this interpreter's own libpython (not the system's) or `import ssl` fails inside models.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libdirs = [sysconfig.get_config_var("LIBDIR"), str(paths["libs"]), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in libdirs if d)
    env.update(MODEL_ENVIRONMENT)
    env["PRISM_PYTHON"] = sys.executable  # tensor-parallel workers: inside the stub, sys.executable is not Python
    return env


def http_ready(port: int, path: str = "/v2/health/ready", timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


# glog's prefix of an error line, E<month><day> <time>: Triton's own ("failed to load 'prism_decision'
# version 1: ..."), the Python backend's and the models' (pb_utils.Logger.log_error)
LOG_ERROR_LINE = re.compile(r"^E\d{4} ")
MODEL_NOT_READY_ROW = re.compile(r"^\|.*\| (UNAVAILABLE|UNLOADING)")  # the model table's state column


def log_summary(text: str, tail_lines: int = 40, max_errors: int = 30) -> str:
    """What a server log says about a failed start: its error lines first (why a model did not
    load: Triton prints them, and the model table with each model's state, long before the option
    table that ends the log of a server that exits), then its last lines."""
    lines = text.splitlines()
    errors = list(dict.fromkeys(line[:2000] for line in lines
                                if LOG_ERROR_LINE.match(line) or MODEL_NOT_READY_ROW.match(line)))
    parts = []
    if errors:
        more = f" (the first {max_errors} of {len(errors)})" if len(errors) > max_errors else ""
        parts.append(f"errors in the log{more}:\n" + "\n".join(errors[:max_errors]))
    parts.append("last log lines:\n" + "\n".join(lines[-tail_lines:]))
    return "\n".join(parts)


def wait_until_serving(process: subprocess.Popen, port: int, path: str, timeout: float, poll: float,
                       describe_exit) -> bool:
    """Poll http://127.0.0.1:{port}{path} until it answers 200 (True) or `timeout` passes (False).
    If `process` exits first: RuntimeError with describe_exit(returncode)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(describe_exit(process.returncode))
        if http_ready(port, path):
            return True
        time.sleep(poll)
    return False


def stop_with_parent() -> None:
    """In the child before exec: if the launching process dies, the server gets SIGTERM (Linux)."""
    die_with_parent(signal.SIGTERM)


def python_stubs(server_pid: int) -> list[int]:
    """The Python-backend stub processes started by tritonserver `server_pid` (one per model instance)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent_of(int(entry.name)) == server_pid:
            try:
                if b"triton_python_backend_stub" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _parent_of(pid: int) -> int | None:
    """Parent pid of a live process; None if it is gone or a zombie (exited, not yet reaped)."""
    try:
        state, ppid = (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2])
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else int(ppid)


def _shm_prefix() -> str:
    return f"prism_{uuid.uuid4().hex[:16]}_"


class TritonServer:
    """A tritonserver process serving a rendered copy of Prism's model repository."""

    def __init__(self, options: ServerOptions, workdir: Path | None = None, log_path: Path | None = None):
        options.validate()
        self.options = options
        RUN_DIR.mkdir(exist_ok=True)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="server-", dir=RUN_DIR))
        self.log_path = log_path or self.workdir / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        self.launched_at = 0.0  # time.monotonic() of the last launch()
        self.ready = False  # the last launch answered /v2/health/ready (started())
        self.stubs: list[int] = []  # its Python-backend stubs once ready, watched by failure()
        self.shm_prefix = _shm_prefix()  # its stubs' shared-memory regions: /dev/shm/<prefix><uuid>

    def _backend_dir(self, paths: dict[str, Path]) -> Path:
        python_dir = self.workdir / "backends" / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        for source in [*paths["backend"].iterdir(), paths["stub"]]:
            if source.is_file():
                link = python_dir / source.name
                if not link.exists():
                    link.symlink_to(source)
        return python_dir.parent

    def command(self) -> list[str]:
        paths = triton_install()
        repo = Path(self.options.repository).resolve() if self.options.repository else \
            render_model_repository(self.options, self.workdir / "model_repository")
        o = self.options
        cmd = [
            str(paths["server"]),
            f"--model-repository={repo}",
            f"--backend-directory={self._backend_dir(paths)}",
            f"--cache-directory={paths['caches']}",
            # Loopback only: the nginx front (router.py) is the way in from anywhere else.
            f"--http-address={LOOPBACK}", f"--grpc-address={LOOPBACK}", f"--metrics-address={LOOPBACK}",
            f"--http-port={o.http_port}", f"--grpc-port={o.grpc_port}", f"--metrics-port={o.metrics_port}",
            *triton_restriction_flags(o.admin_token),
            "--allow-metrics=true", "--exit-timeout-secs=20", NO_AUTO_COMPLETE,
            # regions named for this launch: kill() removes what a killed server leaves (_remove_regions)
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if o.model_control_explicit:
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        return cmd

    def start(self, ready_timeout: float = READY_TIMEOUT_S) -> "TritonServer":
        return self.launch().wait_ready(ready_timeout)

    def launch(self) -> "TritonServer":
        """Start the process without waiting (a cluster launches its replicas side by side, and
        relaunches a failed one while it keeps watching the others: see started())."""
        self.shm_prefix = _shm_prefix()  # a new name each launch: a relaunch never meets the last one's
        cmd = self.command()
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=server_environment(triton_install()),
            start_new_session=True,  # its own process group: we stop it (and its stubs) explicitly
            preexec_fn=stop_with_parent,
        )
        self.launched_at = time.monotonic()
        self.ready = False
        self.stubs = []
        return self

    def wait_ready(self, ready_timeout: float = READY_TIMEOUT_S) -> "TritonServer":
        while not self.started(ready_timeout):
            time.sleep(0.5)
        return self

    def started(self, ready_timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether the launched server is ready (one look, no waiting). Once it is, its stubs are
        recorded for failure() to watch. RuntimeError if it exited while loading, TimeoutError
        (after stopping it) if it is not ready `ready_timeout` seconds after its launch."""
        if self.ready:
            return True
        if self.process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {self.process.returncode}; {self.log_excerpt()}")
        if http_ready(self.options.http_port, "/v2/health/ready"):
            self.stubs = python_stubs(self.process.pid)
            self.ready = True
            return True
        if time.monotonic() - self.launched_at > ready_timeout:
            self.stop()
            raise TimeoutError(f"tritonserver not ready after {ready_timeout:.0f} s; {self.log_excerpt()}")
        return False

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def failure(self) -> str | None:
        """Why this ready server can no longer answer, or None: it exited, or one of its
        Python-backend stubs died (the OOM killer, a crash in native code). Triton 2.51 neither
        restarts a dead stub nor turns readiness false: every request would get HTTP 500 until a
        restart. A server still loading is started()'s to judge."""
        if self.process is None:
            return None
        if self.process.poll() is not None:
            return f"tritonserver exited with code {self.process.returncode}"
        if not self.ready:
            return None
        dead = [pid for pid in self.stubs if _parent_of(pid) != self.process.pid]
        if not dead:
            return None
        try:  # killed together with its stubs (a signal to the group): name the server, the cause
            return f"tritonserver exited with code {self.process.wait(STUB_DEATH_GRACE_S)}"
        except subprocess.TimeoutExpired:
            return f"Python-backend stub(s) {dead} died"

    def log_excerpt(self) -> str:
        """The log's errors and last lines (log_summary)."""
        try:
            return log_summary(self.log_path.read_text(errors="replace"))
        except OSError:
            return "(no log)"

    def interrupt(self) -> None:
        """SIGINT, without waiting: Triton unloads its models and ends their stubs. A cluster
        interrupts all its replicas first, then waits for each (wait_stopped), so they stop side by side."""
        if self.running():
            self.process.send_signal(signal.SIGINT)

    def wait_stopped(self, timeout: float = 30.0) -> int | None:
        """After interrupt(): wait for the graceful exit, then SIGKILL the group: the stubs a crash
        leaves behind, or those of a server interrupted while loading, even when the server itself
        has exited already."""
        if self.process is None:
            return None
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.kill()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (graceful), then SIGKILL the group (wait_stopped)."""
        self.interrupt()
        return self.wait_stopped(timeout)

    def kill(self) -> int | None:
        """SIGKILL the server and its stubs (its process group) at once: a server with a dead stub
        would otherwise spend its whole exit timeout waiting for it."""
        if self.process is None:
            return None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group leader's pid is the group id
        except ProcessLookupError:
            pass
        self.process.wait()
        self._remove_regions()
        return self.process.returncode

    def _remove_regions(self) -> None:
        """A server that exits unloads its models and removes its stubs' shared-memory regions; one
        killed (or whose stub was) leaves them in /dev/shm, 1 MB or more a stub, until the machine
        restarts -- a container's 64 MB /dev/shm would refuse new stubs after a few self-healing
        restarts. The group is dead here (a mapping still open stays valid after the name goes)."""
        for region in SHARED_MEMORY_DIR.glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
