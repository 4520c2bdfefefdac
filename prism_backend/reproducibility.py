"""Thread-count invariance helpers: MKL's strict reproducible mode, and running at a given thread count.

Thread-count-invariant float GEMMs come from MKL's strict conditional numerical reproducibility (CNR).

torch's CPU build does its float32 matrix products (attention's q @ k.T and p @ v inside the SDPA
kernel, the candidate head) with Intel MKL's sgemm. By default MKL picks its code path per call
from the shape *and the number of threads*, and for small products (one to a few query rows, as
the answer rows and short branches are) that path reduces in a different order with 1, 2 or 3
threads: the same request then gets different float32 bits from `--instances 1` and
`--instances 2` (measured: up to 6e-8 in an attention output, enough to flip probability bits).

MKL's documented remedy is CNR mode "AUTO,STRICT": the code branch is chosen per CPU once, and in
strict mode ?gemm gives bitwise identical results whatever the number of threads. It must be set
before MKL's first computation; afterwards MKL refuses a change. Importing `prism_backend` sets
it (prism_backend/__init__.py), the launcher also exports MKL_CBWR for every process it starts,
and the engine's startup self-check reports where it is not in force.

Results still differ between CPU families (another code branch); that is outside the promise.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from pathlib import Path

MKL_CBWR_ENV = "AUTO,STRICT"  # the MKL_CBWR environment value with the same meaning
_AUTO, _STRICT = 2, 0x10000  # MKL_CBWR_AUTO, MKL_CBWR_STRICT from mkl_cbwr.h
_ALL = -1  # MKL_CBWR_ALL: read the whole setting


def _mkl():
    """torch's own (statically linked) MKL, or None for a torch built without it."""
    import torch

    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return lib if hasattr(lib, "mkl_serv_cbwr_set") else None
    except OSError:
        return None


def enable_strict_blas() -> None:
    """Ask MKL for strict CNR. Before torch is imported the environment variable is enough (MKL
    reads it when it starts; measured: mkl_serv_cbwr_get then reports AUTO|STRICT), so importing
    Prism does not import torch. With torch already imported, MKL is told directly; harmless when
    it already computed something (it then keeps its mode; `strict_blas_active` tells) or is absent.
    A strict setting already in the environment is kept, whatever its code branch
    (MKL_CBWR=COMPATIBLE,STRICT: the forced AVX2 path, kernels/cpu/features.py, runs MKL's generic
    code with it, as another CPU vendor would)."""
    if _names_strict(os.environ.get("MKL_CBWR", "")):
        return  # MKL reads it when it starts (or read it already)
    os.environ["MKL_CBWR"] = MKL_CBWR_ENV  # this process's MKL when it starts, and child processes
    if "torch" not in sys.modules:
        return
    lib = _mkl()
    if lib is not None:
        lib.mkl_serv_cbwr_set(_AUTO | _STRICT)


def _names_strict(setting: str) -> bool:
    return "STRICT" in (part.strip().upper() for part in setting.split(","))


def strict_blas_active() -> bool:
    lib = _mkl()
    return lib is not None and bool(lib.mkl_serv_cbwr_get(_ALL) & _STRICT)


def blas_mode_problem() -> str | None:
    """None when strict CNR is in force, else what is wrong (for the startup log)."""
    if _mkl() is None:
        return "torch is not built with MKL: float GEMMs may reduce in a thread-count-dependent order"
    if not strict_blas_active():
        return ("MKL's strict reproducibility mode is not active (MKL ran before prism_backend was "
                f"imported; set MKL_CBWR={MKL_CBWR_ENV} in the environment)")
    return None


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block with torch's intra-op pool at `count` threads (0: unchanged), then restore."""
    import torch

    previous = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
