"""How the benchmarks run a peer engine's driver script inside that engine's own virtualenv: the
spec goes in as JSON, the driver's OUT dict comes back as JSON (stdlib only: the drivers import it
from their virtualenvs too)."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path


def run_driver(python: Path, script: str, spec: dict) -> dict:
    """`python script IN.json OUT.json` with IN = spec; returns OUT."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        subprocess.run([str(python), script, str(src), str(dst)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(dst.read_text())
