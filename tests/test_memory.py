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

import pytest

from prism_backend.config import EngineConfig
from prism_backend.engine import runner
from prism_backend.engine.engine import DecisionEngine
from prism_backend.serving.determinism import synthetic_requests

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


@pytest.mark.parametrize("cache_bytes, chunk_tokens", [(0, 0), (1 << 24, 0), (0, 128)])
def test_a_forward_holds_only_the_k_v_it_hands_on(tiny_model_dir, monkeypatch, cache_bytes, chunk_tokens):
    """run() holds every layer's K/V to its end only for the prefix cache or the next prefill chunk,
    and then each in its own storage: v as a view of the qkv projection's output kept that whole
    output alive (at 1,866 rows ~200 MB of a replica's resident memory, docs/results.md)."""
    engine = DecisionEngine(EngineConfig(model_dir=tiny_model_dir("llama_tied"), prefix_cache_bytes=cache_bytes,
                                         prefill_chunk_tokens=chunk_tokens))
    model, handed_on = engine.runner.model, []
    run = model.run

    def recording_run(*args, **kwargs):
        hidden, kv = run(*args, **kwargs)
        handed_on.append(kv)
        return hidden, kv

    monkeypatch.setattr(model, "run", recording_run)
    engine.score(synthetic_requests(engine.spec.vocab_size))
    assert (len(handed_on) > 1) == (chunk_tokens > 0)
    for n, kv in enumerate(handed_on):
        needed = cache_bytes > 0 or n + 1 < len(handed_on)
        assert (kv is not None) == needed, n
        for tensor in [t for pair in kv or [] for t in pair]:
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
