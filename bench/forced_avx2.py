"""An AVX-512 machine acting as an AVX2-only one for a whole benchmark: the stand-in for the AVX2 kind
when no such machine is drawn (`bench/side_by_side.py --force-avx2`, `make bench-forced-avx2`).

Every engine's processes run with STANDIN_ENVIRONMENT:
- Prism: its kernels capped to AVX2 (PRISM_CPU_ISA; kernels/cpu/features.py) and every exact product
  on the int16 route (PRISM_EXACT_ROUTE): the route an AVX2-only CPU's route timing picks, where
  `torch._int_mm` is a plain loop -- here oneDNN, capped to AVX2 for vLLM's sake, would run it with
  saturating pair sums (features.py says why that combination exists on no real machine);
- torch's own dispatch (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and MKL's
  (MKL_ENABLE_INSTRUCTIONS) at AVX2, for every engine;
- vLLM: torch's CPU probes answering as an AVX2 CPU's (avx2_site/sitecustomize.py), so that vLLM loads
  its AVX2 kernel library and attention, in fp32 (its fastest dtype without bf16 dot products);
- llama.cpp: built without AVX-512 (`.venv-llama-avx2`; llama_cpp_driver.LLAMA_PYTHON).
What it is not: an AVX2-only CPU. The cores are still this machine's, running AVX2 code at their own
rates (a Zen 4 executes 256-bit vectors at full width, a Zen 1 in two halves) with their own caches,
so a ratio measured here estimates the AVX2 kind's, it does not replace it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from kernels.cpu.features import AVX2_ENVIRONMENT, ISA_VARIABLE, cpu_has_avx512_itself
from prism_backend.model.exact_matmul import ROUTE_VARIABLE

SITE = Path(__file__).resolve().parent / "avx2_site"
STANDIN_ENVIRONMENT = {
    ISA_VARIABLE: AVX2_ENVIRONMENT[ISA_VARIABLE],
    "ATEN_CPU_CAPABILITY": AVX2_ENVIRONMENT["ATEN_CPU_CAPABILITY"],
    ROUTE_VARIABLE: "int16",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def active() -> bool:
    """Whether this process runs under STANDIN_ENVIRONMENT (all of it)."""
    return all(os.environ.get(k) == v for k, v in STANDIN_ENVIRONMENT.items()) and \
        str(SITE) in os.environ.get("PYTHONPATH", "").split(os.pathsep)


def reexec() -> None:
    """Start this script again under STANDIN_ENVIRONMENT, unless it already runs so: torch reads its
    capability when it loads, and the peers' drivers inherit the environment. Refuses on a CPU
    without AVX-512, which is the AVX2 kind itself (run the benchmark plainly there)."""
    if active():
        return
    if not cpu_has_avx512_itself():
        sys.exit("--force-avx2 makes an AVX-512 machine act as an AVX2 one; this CPU has no AVX-512: "
                 "run the benchmark without it")
    env = dict(os.environ, **STANDIN_ENVIRONMENT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
