"""Explicit model control: unload and load again without leaking stub processes; the launcher's
server stops with its parent; shutdown leaves no stub behind. (`prism serve` stopping on Ctrl-C:
tests/test_security.py.)"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from prism_client.client import PrismClient
from prism_launcher.security import ADMIN_HEADER
from prism_launcher.server import ServerOptions, TritonServer, python_stubs

from helpers import SAMPLE_TICKET, free_port, wait_for

pytestmark = pytest.mark.server  # every test here starts a tritonserver


def options(model_dir, **kw):
    return ServerOptions(precision="int8", http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), model_dir=model_dir, **kw)


def test_unload_and_reload_without_leaking_stubs(model_dir):
    token = "model-control-test-token"
    with TritonServer(options(model_dir, model_control_explicit=True, admin_token=token)) as server:
        pid = server.process.pid
        url = f"localhost:{server.options.http_port}"
        admin = httpclient.InferenceServerClient(url, network_timeout=600)  # an int8 load can take minutes on 2 busy cores
        headers = {ADMIN_HEADER: token}  # Triton restricts its repository API to the admin token
        first = PrismClient(url).decide(SAMPLE_TICKET, ["team"])[0]
        assert len(python_stubs(pid)) == 3  # tokenizer, decision, postprocess
        for _ in range(2):
            for name in ("prism", "prism_tokenizer", "prism_decision", "prism_postprocess"):
                admin.unload_model(name, headers=headers)
            assert wait_for(lambda: not python_stubs(pid)), python_stubs(pid)
            assert not PrismClient(url).is_ready()
            admin.load_model("prism", headers=headers)  # loads its composing models too
            assert wait_for(lambda: PrismClient(url).is_ready(), timeout=240)  # int8 loads are slow on 2 busy cores
            assert len(python_stubs(pid)) == 3
            again = PrismClient(url).decide(SAMPLE_TICKET, ["team"])[0]
            assert again.probability_array().tobytes() == first.probability_array().tobytes()
    assert server.process.returncode is not None
    assert not python_stubs(pid)


def test_server_stops_when_its_launcher_dies(model_dir, tmp_path):
    """A launcher killed with SIGKILL takes its tritonserver (and the stubs) down with it."""
    http_port = free_port()
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from prism_launcher.server import ServerOptions, TritonServer\n"
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
    assert wait_for(lambda: not python_stubs(server_pid), timeout=30)
