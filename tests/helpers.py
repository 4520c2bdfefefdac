"""Helpers the tests share (import them from here, not from conftest): skips for what this CPU lacks.

An ISA-specific test skips with a reason that starts with ISA_SKIP, naming the instructions; the
run's closing summary (conftest.py) lists those skips beside the CPU kind, so a green run says what
it covered.
"""
from __future__ import annotations

import pytest

from kernels.cpu.features import cpu_kind, has_avx2, has_avx512_vnni

ISA_SKIP = "this CPU lacks"
_NEEDS = {"avx2": (has_avx2, "AVX2 + FMA"), "avx512_vnni": (has_avx512_vnni, "AVX-512 VNNI")}


def isa_reason(isa: str) -> str:
    return f"{ISA_SKIP} {_NEEDS[isa][1]} ({cpu_kind()})"


def needs(isa: str):
    """A mark: skip unless this CPU has `isa` ('avx2' or 'avx512_vnni')."""
    has, _ = _NEEDS[isa]
    return pytest.mark.skipif(not has(), reason=isa_reason(isa))


def skip_unless_route_available(route: str) -> None:
    """Skip the calling test where the exact-product route `route` (prism_backend/model/exact_matmul.py)
    cannot run on this CPU at all, naming the instructions it lacks."""
    from kernels.cpu import exact_gemm

    if route == "vnni8" and not exact_gemm.vnni8_available():
        pytest.skip(isa_reason("avx512_vnni"))
    if route in ("int16", "vnni8") and exact_gemm.load() is None:
        pytest.skip(isa_reason("avx2") if not has_avx2() else f"the kernel library: {exact_gemm.why_not()}")
