"""A replica's resident memory: building a model hands the heap it freed back to the OS.

Loading, rotating and GPTQ free about 1 GB of float temporaries; without malloc_trim glibc keeps
them mapped (measured on SmolLM2-135M, int8: 1348 MiB resident after building, 891 MiB with it,
322 MiB of live tensors). The sizes are a benchmark's business (bench/side_by_side.py); these tests
check the mechanism and that building uses it.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

from prism_backend.config import EngineConfig
from prism_backend.engine import runner

# Frees 256 MiB of 64 KiB blocks (below glibc's mmap threshold, so they live in the heap) behind one
# block kept alive, so free() cannot shrink the heap's top by itself; prints resident MiB before and
# after return_freed_heap.
_FRAGMENTED_HEAP = textwrap.dedent("""
    import torch
    from prism_backend.engine.runner import return_freed_heap

    def resident_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

    blocks = [torch.ones(16 * 1024) for _ in range(4096)]  # 4096 x 64 KiB
    keep = torch.ones(16 * 1024)
    del blocks
    before = resident_mib()
    return_freed_heap()
    print(before, resident_mib())
""")


def test_return_freed_heap_gives_freed_pages_back():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert before - after >= 200, f"resident {before} MiB -> {after} MiB: the freed 256 MiB stayed mapped"


def test_building_a_model_returns_the_freed_heap(tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "return_freed_heap", lambda: calls.append(1))
    for precision in ("int8", "exact", "fp32"):
        runner.build_model(EngineConfig(model_dir=tiny_model_dir("llama_tied"), precision=precision))
    assert len(calls) == 3
