"""Both CPU kinds from one machine: an AVX-512 VNNI machine forced onto the AVX2 path picks what an
AVX2-only one picks, and the engine's determinism holds there (kernels/cpu/features.py)."""
import json
import os

import pytest

from kernels.cpu import exact_gemm, features as cpu_features

from helpers import GOLDEN_DECISIONS_PATH, run_snippet


@pytest.fixture
def forced_avx2(monkeypatch):
    """This process's Prism kernels as on an AVX2-only CPU (torch's own dispatch is fixed at start:
    the subprocess test below covers it)."""
    monkeypatch.setenv(cpu_features.ISA_VARIABLE, "avx2")
    cpu_features.cpu_flags.cache_clear()
    yield
    monkeypatch.delenv(cpu_features.ISA_VARIABLE)
    cpu_features.cpu_flags.cache_clear()


def test_forcing_avx2_hides_the_8_bit_kernel(forced_avx2, monkeypatch):
    from prism_backend.model import exact_matmul

    assert not cpu_features.has_avx512_vnni() and not exact_gemm.vnni8_available()
    assert cpu_features.cpu_kind() in ("AVX2 (forced)", "other (forced)")
    assert not exact_matmul.runs_here("vnni8", 127, 127)
    assert not any(f.startswith("avx512") for f in cpu_features.cpu_flags() or ())
    monkeypatch.setenv("PRISM_EXACT_ROUTE", "vnni8")
    monkeypatch.setattr(exact_matmul, "_route", None)
    with pytest.raises(RuntimeError, match="AVX-512 VNNI"):
        exact_matmul.route(1, 1)


def test_an_unknown_isa_cap_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_features.ISA_VARIABLE, "avx9")
    cpu_features.cpu_flags.cache_clear()
    try:
        with pytest.raises(ValueError, match="PRISM_CPU_ISA must be one of"):
            cpu_features.cpu_flags()
    finally:
        monkeypatch.delenv(cpu_features.ISA_VARIABLE)
        cpu_features.cpu_flags.cache_clear()


# In a process started as on an AVX2-only CPU: the int8 default (8-bit integers, one pass a side)
# and the exact precision (13-bit, two passes) take a route that CPU has, the served self-check (batch composition, cache state, thread count)
# finds nothing that breaks bit-identity, and the fixed requests get the golden bits (calibrated afresh: the cache key holds the CPU kind),
# with MKL on its generic code branch (what MKL leaves to the CPU, e.g. torch's float32 sqrt, then changes).
AVX2_ENGINE_CHECK = """
import json, sys, torch
from helpers import REGISTRY, decision_digests
from prism_backend.config import EngineConfig
from prism_backend.model import exact_matmul
from prism_backend.serving.decision_step import DecisionStep
from prism_backend.serving.pipeline import DecisionPipeline
from kernels.cpu.features import cpu_kind
from prism_backend.reproducibility import _mkl
mkl = _mkl().mkl_serv_cbwr_get(-1) if _mkl() is not None else None
out = {"kind": cpu_kind(), "torch": torch.backends.cpu.get_cpu_capability(), "mkl": mkl, "rungs": {}}
for precision, passes in (("exact", 2), ("int8", 1)):
    config = EngineConfig(model_dir=sys.argv[1], precision=precision, num_threads=2)
    pipeline = DecisionPipeline(config.replace(prefix_cache_bytes=0), REGISTRY)
    step = DecisionStep(config, share_weights_with=pipeline.engine)  # the served self-check, on the same model
    out["rungs"][precision] = {"route": exact_matmul.route(passes, passes), "problems": step.self_check_problems,
                               "digests": decision_digests(pipeline)}
print(json.dumps(out))
"""


def test_the_engine_on_the_forced_avx2_path_is_deterministic(model_dir):
    result = run_snippet(AVX2_ENGINE_CHECK, model_dir, env=cpu_features.AVX2_ENVIRONMENT,
                         unset=("PRISM_EXACT_ROUTE", "PRISM_INT8_ROUTE"))
    assert result["kind"] == "AVX2 (forced)" and result["torch"] == "AVX2", result
    assert result["mkl"] == 0x10000 | 3, result  # MKL_CBWR_COMPATIBLE | MKL_CBWR_STRICT: another vendor's MKL code
    assert set(result["rungs"]) == {"exact", "int8"}
    golden = json.loads(GOLDEN_DECISIONS_PATH.read_text())  # the same bits as on every other CPU (test_replay.py)
    for passes, rung in result["rungs"].items():
        # a route an AVX2-only CPU has (never the 8-bit kernel); which wins is timed: on a real AVX2
        # CPU `int_mm` is torch's slow loop and loses to int16, here it is oneDNN's VNNI kernel
        assert rung["route"] in ("int16", "int_mm", "float"), (passes, rung)
        assert rung["problems"] == [], (passes, rung)
        assert rung["digests"] == golden[passes], (passes, rung)


# The eval's and the benchmarks' Hugging Face bf16 reference in a process started as on an AVX2-only
# CPU: on an AVX-512 machine torch's bf16 SDPA failed there (features.torch_below_cpu), so the
# reference takes the eager attention; a prompt as long as a ticket's (the path that failed) gives
# candidate probabilities. Natively, and on a real AVX2-only CPU, it keeps SDPA.
AVX2_BF16_REFERENCE = """
import json, sys, torch
from kernels.cpu.features import torch_below_cpu
from prism_launcher.reference import HFReference
reference = HFReference(sys.argv[1], torch.bfloat16)
p = reference.candidate_probabilities(list(range(1000, 1400)), [330, 331, 332])
print(json.dumps({"below": torch_below_cpu(), "attention": reference.attention, "sum": float(p.sum()),
                  "finite": bool(torch.isfinite(torch.from_numpy(p)).all())}))
"""


def test_the_bf16_reference_runs_on_the_forced_avx2_path(model_dir):
    result = run_snippet(AVX2_BF16_REFERENCE, model_dir, env=cpu_features.AVX2_ENVIRONMENT)
    avx512_cpu = cpu_features.cpu_has_avx512_itself()
    assert result["below"] == avx512_cpu and result["attention"] == ("eager" if avx512_cpu else "sdpa"), result
    assert result["finite"] and abs(result["sum"] - 1.0) < 1e-3, result
    # this process: at the CPU's own level, unless the suite itself runs forced (README's AVX2 command)
    assert cpu_features.torch_below_cpu() == (avx512_cpu and os.environ.get("ATEN_CPU_CAPABILITY") == "avx2")
