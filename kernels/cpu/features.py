"""What this x86 CPU can run, as Prism's own kernels see it, and how to make a machine act as the
other kind.

Prism runs on two kinds of x86-64 machine: AVX2 + FMA only (no AVX-512), and AVX-512 F/BW/VL with
VNNI (and BF16). Of the exact GEMMs (exact_gemm.py) the int16 kernel needs AVX2 and the 8-bit
kernel AVX-512 VNNI. Everything that picks a kernel asks here, so one switch makes an AVX-512
machine pick exactly what an AVX2-only one picks:

    PRISM_CPU_ISA=avx2   Prism's kernels ignore the CPU's AVX-512 flags (read once per process).

torch chooses its own kernels when it starts; AVX2_ENVIRONMENT sets its switch too
(ATEN_CPU_CAPABILITY), so a process started with it computes as on an AVX2-only CPU as far as
software can arrange (tests/test_cpu_kinds.py runs the engine that way; `make test` with it runs the
whole suite so; 2026-12-06, on the Intel Xeon with AMX, it found torch's bf16 attention failing
there (torch_below_cpu) and two fp32 tests comparing bits across MKL branches or batches; the servers
the suite starts run MKL's AUTO,STRICT branch, as the launcher starts every model). Not oneDNN's ONEDNN_MAX_CPU_ISA=AVX2: torch still hands `torch._int_mm` to oneDNN
where the CPU has VNNI, and oneDNN's AVX2 int8 kernel then saturates int16 pair sums (vpmaddubsw:
measured wrong sums for 8-bit operands), a combination no real machine runs (an AVX2-only CPU takes
torch's own exact loop). MKL's code branch goes further than an AVX2 CPU: MKL_CBWR=COMPATIBLE,STRICT,
MKL's generic code (which Prism otherwise sets to AUTO,STRICT: the branch MKL picks for the CPU,
which differs between vendors), so anything Prism leaves to MKL -- its BLAS, and the vector math
behind torch's float32 sqrt, pow and exp -- shows up as other bits in the golden digests (an Intel
Xeon and an AMD EPYC once served `exact` differently through torch's sqrt: model/smoothing.py).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

ISA_VARIABLE = "PRISM_CPU_ISA"
ISA_CHOICES = ("native", "avx2")
# A child process started with these computes as on an AVX2-only CPU: Prism's kernels and torch's
# dispatch (ATen's CPU capability); MKL on its generic code branch, as on another vendor's CPU.
AVX2_ENVIRONMENT = {ISA_VARIABLE: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT"}


def _isa_cap() -> str:
    cap = os.environ.get(ISA_VARIABLE, "") or "native"
    if cap not in ISA_CHOICES:
        raise ValueError(f"{ISA_VARIABLE} must be one of {ISA_CHOICES}, got {cap!r}")
    return cap


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo, or None where it cannot be read (not Linux x86)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(field))
    except (OSError, StopIteration):
        return None


def _own_flags() -> frozenset[str] | None:
    """The CPU's own feature flags from /proc/cpuinfo, whatever PRISM_CPU_ISA caps; None where they
    cannot be read (not Linux x86)."""
    line = _cpuinfo("flags")
    return None if line is None else frozenset(line.split())


@functools.cache  # read once per process: the 8-bit kernel's callers ask on every call
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (without AVX-512 ones under PRISM_CPU_ISA=avx2),
    or None where they cannot be read (not Linux x86)."""
    flags = _own_flags()
    if flags is None:
        return None
    if _isa_cap() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


def has_avx2() -> bool:
    """Whether this CPU runs the int16 kernel's instructions (AVX2 and FMA; x86 only)."""
    flags = cpu_flags()
    if flags is None:
        import torch

        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return {"avx2", "fma"} <= flags


def has_avx512_vnni() -> bool:
    """Whether this CPU runs the 8-bit kernel (AVX-512 F/BW/VL/DQ and VNNI)."""
    flags = cpu_flags()
    return flags is not None and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags


def has_avx512() -> bool:
    """Whether this CPU runs AVX-512 F/DQ/VL/BW (tree attention's 16-lane instance)."""
    flags = cpu_flags()
    return flags is not None and {"avx512f", "avx512dq", "avx512vl", "avx512bw"} <= flags


def wide_lanes(wide: bool | None, what: str) -> bool:
    """Whether a kernel with a 16-lane (AVX-512) and an 8-lane (AVX2) instance of the same bits runs the
    16-lane one: `wide` as asked, or where the CPU has AVX-512 when None. Asking for it on a CPU
    without AVX-512 is an error naming `what`."""
    if wide is None:
        return has_avx512()
    if wide and not has_avx512():
        raise RuntimeError(f"the 16-lane instance of {what} needs a CPU with AVX-512 F/DQ/VL/BW")
    return wide


def has_amx_int8() -> bool:
    """Whether this CPU has Intel's AMX tiles with int8 products (the 8-bit kernel's AMX variant)."""
    flags = cpu_flags()
    return flags is not None and {"amx_tile", "amx_int8"} <= flags and has_avx512_vnni()


def cpu_kind() -> str:
    """The machine kind in words, as results and test runs report it: 'AVX-512 VNNI + BF16' (with
    ' + AMX' where the CPU has Intel's matrix tiles, which oneDNN -- so torch's and vLLM's bf16 --
    and Prism's 8-bit kernel use), 'AVX-512 VNNI', 'AVX2' or 'other', with ' (forced)' where
    PRISM_CPU_ISA caps it."""
    flags = cpu_flags() or frozenset()
    if has_avx512_vnni():
        kind = "AVX-512 VNNI + BF16" if "avx512_bf16" in flags else "AVX-512 VNNI"
        kind += " + AMX" if {"amx_int8", "amx_bf16"} <= flags else ""
    elif has_avx2():
        kind = "AVX2"
    else:
        kind = "other"
    return kind + (" (forced)" if _isa_cap() != "native" else "")


def torch_below_cpu() -> bool:
    """Whether torch's kernels were started below this CPU's AVX-512 (ATEN_CPU_CAPABILITY=avx2 on an
    AVX-512 machine: AVX2_ENVIRONMENT's forced AVX2 path). torch 2.13's bfloat16 attention (SDPA)
    still asks the CPU itself whether to pack its operands for AMX tiles, and that packing is
    compiled into its AVX-512 kernels only: on the Intel Xeon with AMX it failed there with
    'pack_vnni2 is only supported when avx512 is supported' (the eval's Hugging Face bf16 reference,
    2026-12-06). A real AVX2-only CPU never packs. Reads the CPU's own flags, not PRISM_CPU_ISA's."""
    import torch

    return cpu_has_avx512_itself() and torch.backends.cpu.get_cpu_capability() != "AVX512"


def cpu_has_avx512_itself() -> bool:
    """Whether the CPU itself has AVX-512 (its own flags, whatever PRISM_CPU_ISA caps)."""
    return "avx512f" in (_own_flags() or ())


def cpu_has_bf16_itself() -> bool:
    """Whether the CPU itself has bf16 dot products (AVX-512 BF16 or AMX-BF16; its own flags, whatever
    PRISM_CPU_ISA caps): where torch's and vLLM's bf16 run natively rather than emulated."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(_own_flags() or ())


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('AMD EPYC 9R14 ...', 'Intel(R) Xeon(R) Processor'),
    or 'unknown': results name it beside the kind, since two CPUs of one kind still differ in speed."""
    return _cpuinfo("model name") or "unknown"


def machine() -> str:
    """Kind and model in one phrase, for the header of a result."""
    return f"{cpu_kind()} ({cpu_model()})"
