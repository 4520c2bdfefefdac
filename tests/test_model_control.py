"""Explicit model control: unload and load again without leaking stub processes; the launcher's
server stops with its parent; shutdown leaves no stub behind."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import tritonclient.http as httpclient

from prism_client.client import PrismClient
from prism_client.server import ServerOptions, TritonServer

from conftest import SAMPLE_TICKET, free_port, processes_with, wait_for


def stubs_of(pid: int) -> list[int]:
    """Python-backend stub processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"triton_python_backend_stub" in cmdline:
            found.append(int(entry.name))
    return found


def options(model_dir, **kw):
    return ServerOptions(precision="int8", http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), model_dir=model_dir, **kw)


def test_unload_and_reload_without_leaking_stubs(model_dir):
    with TritonServer(options(model_dir, model_control_explicit=True)) as server:
        pid = server.process.pid
        url = f"localhost:{server.options.http_port}"
        admin = httpclient.InferenceServerClient(url)
        first = PrismClient(url).decide(SAMPLE_TICKET, ["team"])[0]
        assert len(stubs_of(pid)) == 3  # tokenizer, decision, postprocess
        for _ in range(2):
            for name in ("prism", "prism_tokenizer", "prism_decision", "prism_postprocess"):
                admin.unload_model(name)
            assert wait_for(lambda: not stubs_of(pid)), stubs_of(pid)
            assert not PrismClient(url).is_ready()
            admin.load_model("prism")  # loads its composing models too
            assert wait_for(lambda: PrismClient(url).is_ready(), timeout=240)  # an int8 load calibrates first
            assert len(stubs_of(pid)) == 3
            again = PrismClient(url).decide(SAMPLE_TICKET, ["team"])[0]
            assert again.probability_array().tobytes() == first.probability_array().tobytes()
    assert server.process.returncode is not None
    assert not stubs_of(pid)


def test_server_stops_when_its_launcher_dies(model_dir, tmp_path):
    """A launcher killed with SIGKILL takes its tritonserver (and the stubs) down with it."""
    http_port = free_port()
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from prism_client.server import ServerOptions, TritonServer\n"
        f"s = TritonServer(ServerOptions(http_port={http_port}, grpc_port={free_port()}, "
        f"metrics_port={free_port()}, model_dir=Path({str(model_dir)!r}))).start()\n"
        "print(s.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    assert PrismClient(f"localhost:{http_port}").is_ready()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()

    def gone():
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        # a zombie (reaped by init later) counts as gone
        return Path(f"/proc/{server_pid}/stat").read_text().split(") ")[1].startswith("Z")

    assert wait_for(gone, timeout=60)
    assert wait_for(lambda: not stubs_of(server_pid), timeout=30)


def test_prism_serve_stops_cleanly_on_ctrl_c(model_dir):
    """`prism serve` (what `make serve` runs): ready line, then SIGINT stops server and stubs."""
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "prism_client.cli", "serve", "--model-dir", str(model_dir),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    started = proc.stderr.readline()  # "prism: starting tritonserver (log: <workdir>/tritonserver.log)"
    workdir = started.split("(log: ", 1)[1].rsplit("/", 1)[0].encode()
    line = proc.stdout.readline()
    assert "ready" in line and f"localhost:{ports[0]}" in line, line + proc.stderr.read()
    assert PrismClient(f"localhost:{ports[0]}").decide(SAMPLE_TICKET, ["team"])[0].task == "team"

    def processes_of_this_server():  # tritonserver and its stubs all name the server's workdir
        return processes_with(workdir)

    assert len(processes_of_this_server()) == 4  # tritonserver + 3 stubs
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert "server stopped" in proc.stderr.read()
    assert wait_for(lambda: not processes_of_this_server(), timeout=30), processes_of_this_server()
    assert not PrismClient(f"localhost:{ports[0]}").is_ready()

