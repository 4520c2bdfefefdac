"""Exact integer GEMMs for x86 CPUs: int16 x int16 (AVX2, and AVX-512 VNNI), uint8 x int8 (AVX-512
VNNI, or AMX tiles) and integers of one or two base-128 digits (AMX tiles), all with exact int32 sums
widened to float64, Prism's row quantisation and its dequantising epilogue fused in. One C++ library
(csrc/exact_gemm.cpp), built with g++ on first use: PackedWeight is the int16 kernel (AVX2, or
`vnni=True` for its AVX-512 VNNI form), PackedWeight8 the 8-bit one (one quantisation pass a side;
`amx=True` for its AMX variant), AmxDigitWeight the AMX digits kernel, and DigitWeight feeds
torch._int_mm (oneDNN) the library's digits and combines its products.

Why it exists: on CPUs without VNNI, int8 arithmetic runs at the float32 FMA rate, so Prism's exact
products used to cost one float64 GEMM (2x a float32 one). AVX2's vpmaddwd multiplies int16 pairs
at the FMA rate too, so a 13-bit x 13-bit exact product with int32 partial sums costs about one
float32 GEMM. Its torch reference is `x_int.double() @ w_int.double()` (tests/test_exact_gemm_cpu.py).
The engine's exact integer product (prism_backend/model/exact_matmul.py) picks these kernels where
they are the fastest exact route.

The shared library is compiled once per source version (its name carries a hash of the source and
flags) into the first writable folder of: PRISM_KERNEL_CACHE, lib/ next to this file (an exported
model repository carries it there, kernels/cpu/lib, for servers without g++), a temporary folder of
this user; a library already in any of them is used as it is. (No ~/.cache folder: Prism's
user-cache rule is prism_backend.paths.user_cache_dir, and the kernels import nothing of Prism.) It is loaded with ctypes, which releases the GIL for the call. Where
it cannot be built or loaded (no g++, no AVX2, another architecture) `load()` returns None and
callers use another exact route.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.cpu.features import has_amx_int8, has_avx2, has_avx512_vnni, wide_lanes  # noqa: F401 (callers ask here too)
from kernels.cpu.prologues import ROTARY_HEAD, Prologue, RmsNorm, Rotary, SwiGLU

CSRC = Path(__file__).parent / "csrc"
# the one library holds every CPU kernel: these GEMMs, tree attention (kernels/cpu/tree_attention.py),
# the decoder's row-wise passes (kernels/cpu/rowwise.py), a decoder layer in one call over them all
# (kernels/cpu/decoder_layer.py) and the calibration's float64 steps (kernels/cpu/calibration.py); the
# headers they include are in CSRC too
SOURCES = tuple(CSRC / name for name in ("exact_gemm.cpp", "tree_attention.cpp", "rowwise.cpp", "decoder_layer.cpp",
                                         "calibration.cpp"))
PACKAGE_LIB = Path(__file__).parent / "lib"  # kernels/cpu/lib: where an export puts the built library
PANEL = 16  # output columns per packed panel (NR in the source)
INT32_MAX = 2**31 - 1
# -ffp-contract=off: the fused epilogue must round exactly as torch's unfused one does
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]

_lib = None
_why_not: str | None = None


def _cache_dirs() -> list[Path]:
    env = [Path(os.environ["PRISM_KERNEL_CACHE"])] if os.environ.get("PRISM_KERNEL_CACHE") else []
    # the package folder is writable in a checkout; an installed or read-only one falls to the temporary folder
    return [*env, PACKAGE_LIB, Path(tempfile.gettempdir()) / f"prism-kernels-{os.getuid()}"]


def library_name() -> str:
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sorted(CSRC.iterdir())) + " ".join(FLAGS).encode())
    return f"exact_gemm-{digest.hexdigest()[:16]}.so"


def _build() -> Path:
    """The library's path: found in a cache folder, else compiled into the first writable one."""
    folders, name = _cache_dirs(), library_name()
    for folder in folders:
        if (folder / name).exists():
            return folder / name
    errors = []
    for folder in folders:
        target = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".{target.name}.{os.getpid()}"  # instances may build at once: rename is atomic
            _compile(partial)
            os.replace(partial, target)
            return target
        except (OSError, subprocess.CalledProcessError) as exc:
            errors.append(f"{folder}: {getattr(exc, 'stderr', '') or exc}")
    raise RuntimeError("; ".join(errors))


def _compile(target: Path) -> None:
    """g++ FLAGS -o target SOURCES, each source compiled by its own g++ at once and then linked: the same
    objects as one g++ call compiles one after another (~10 s on the Zen 4, ~5 on its two cores so)."""
    with tempfile.TemporaryDirectory(prefix=f"{target.name}.objects.", dir=target.parent) as folder:
        objects = [str(Path(folder) / f"{source.stem}.o") for source in SOURCES]
        jobs = [subprocess.Popen(["g++", *(f for f in FLAGS if f != "-shared"), "-c", "-o", obj, str(source)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for source, obj in zip(SOURCES, objects)]
        results = [(job, *job.communicate()) for job in jobs]  # every compiler waited for, failed or not
        for job, out, err in results:
            if job.returncode:
                raise subprocess.CalledProcessError(job.returncode, job.args, out, err)
        subprocess.run(["g++", *FLAGS, "-o", str(target), *objects], check=True, capture_output=True, text=True)


def load():
    """The loaded library, or None where it cannot be built here (why_not() says why)."""
    global _lib, _why_not
    if _lib is None and _why_not is None:
        if not has_avx2():
            _why_not = "needs a CPU with AVX2 and FMA"
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, RuntimeError) as exc:
            _why_not = f"could not build {', '.join(s.name for s in SOURCES)}: {exc}"
            return None
        lib.prism_quantize_rows.restype = None
        lib.prism_quantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.prism_int16_gemm.restype = None
        # the VNNI kernels' tail: cos, sin, rotary_cols, out2, split
        rotary_tail = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.prism_int16_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
        lib.prism_vnni16_gemm.restype = None
        lib.prism_vnni16_gemm.argtypes = lib.prism_int16_gemm.argtypes + rotary_tail
        lib.prism_quantize_rows_u8.restype = None
        lib.prism_quantize_rows_u8.argtypes = lib.prism_quantize_rows.argtypes
        lib.prism_vnni8_gemm.restype = None
        eight_bit_argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_int]  # x .. swiglu
        lib.prism_vnni8_gemm.argtypes = eight_bit_argtypes + rotary_tail
        lib.prism_quantize_rows_digits.restype = None
        lib.prism_quantize_rows_digits.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.prism_amx_digits_gemm.restype = None
        lib.prism_amx_digits_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 5 + [
                                              ctypes.c_int]
        lib.prism_combine_digits.restype = None
        lib.prism_combine_digits.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [
                                             ctypes.c_void_p] * 5 + [ctypes.c_int]
        lib.prism_amx8_gemm.restype = None
        lib.prism_amx8_gemm.argtypes = eight_bit_argtypes  # prism_vnni8_gemm's without the rotary epilogue's tail
        lib.prism_amx_init.restype = ctypes.c_int
        lib.prism_amx_init.argtypes = []
        lib.prism_tree_attention.restype = None
        lib.prism_tree_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_void_p] + [ctypes.c_int] * 3 + [
            ctypes.c_long] * 3  # ldq, ldk, ldv
        lib.prism_decoder_layer.restype = None  # (layer, forward: decoder_layer.py's structures; h, kv, h_out)
        lib.prism_decoder_layer.argtypes = [ctypes.c_void_p] * 5
        lib.prism_rms_norm.restype = None
        lib.prism_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_int]
        lib.prism_swiglu.restype = None
        lib.prism_swiglu.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.prism_hadamard_rows.restype = None
        lib.prism_hadamard_rows.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5
        for kind in ("i16", "u8"):  # the row passes with the next projection's quantiser in the same pass
            rms = getattr(lib, f"prism_rms_norm_quantize_{kind}")
            rms.restype = None
            rms.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            glu = getattr(lib, f"prism_swiglu_quantize_{kind}")
            glu.restype = None
            glu.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                                    ctypes.c_int, ctypes.c_int]
            getattr(lib, f"prism_hadamard_quantize_{kind}").restype = None
            getattr(lib, f"prism_hadamard_quantize_{kind}").argtypes = glu.argtypes
        # ... and into base-128 digits: (..., bound, passes, q, ldq, mp, scale, wide, threads)
        digits_tail = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int]
        lib.prism_rms_norm_quantize_digits.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                       ctypes.c_float] + digits_tail
        for name in ("swiglu", "hadamard"):
            getattr(lib, f"prism_{name}_quantize_digits").argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + digits_tail
        for name in ("rms_norm", "swiglu", "hadamard"):
            getattr(lib, f"prism_{name}_quantize_digits").restype = None
        lib.prism_rotary.restype = None
        lib.prism_rotary.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 3 + [
            ctypes.c_int]
        lib.prism_gptq_block.restype = None  # (w, rows, width, ldw, s, u, ldu, bound, q, ldq, err, lderr)
        lib.prism_gptq_block.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_long, ctypes.c_double, ctypes.c_void_p, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_long]
        lib.prism_hessian_add.restype = None  # (q, rows, width, ends, scales, groups, h, threads)
        lib.prism_hessian_add.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.prism_hadamard_f64.restype = None  # (x, vectors, order, factors, count, signs)
        lib.prism_hadamard_f64.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p]
        _lib = lib
    return _lib


def _library():
    lib = load()
    if lib is None:
        raise RuntimeError(f"the exact GEMM library is not available here: {_why_not}")
    return lib


def built_library() -> Path | None:
    """The path of the loadable library (building it if needed), or None where it cannot be."""
    return _build() if load() is not None else None


def why_not() -> str | None:
    return _why_not


def chunk_pairs(x_bound: int, w_bound: int) -> int:
    """How many k-pairs an int32 lane may sum at the integers' bounds without any possibility of
    overflow: the kernel's block (it sums runs of whole blocks that the data's own bound allows)."""
    return max(1, INT32_MAX // (2 * x_bound * w_bound))


def fits(x_bound: int, w_bound: int) -> bool:
    """Whether integers of these bounds can use this kernel (int16 operands, no overflow in one pair)."""
    return max(x_bound, w_bound) < 2**15 and 2 * x_bound * w_bound <= INT32_MAX


def _quantize_rows(x: torch.Tensor, k: int, x_bound: int, width: int, dtype: torch.dtype, row_multiple: int = 1,
                   pad: int = 0, wide: bool | None = None, prologue: Prologue = None):
    """The library's row quantiser on x (M, K) -> (its operand (M, width) of `dtype`, int16 or uint8
    holding q + 128, the row scales (M, 1) float32). With row_multiple > 1 the operand is a view of
    the first M rows of a buffer whose further rows, up to a multiple of row_multiple, hold `pad` (the
    AMX kernel's tiles). wide: 16 lanes at a time (AVX-512; the default where the CPU has it) or 8 --
    the same integers. prologue: quantise the rows of that pass over x instead (x (M, K) for RmsNorm
    and Hadamard, (M, 2 K) for SwiGLU), computed in the quantiser's pass (prologues.py)."""
    wide = wide_lanes(wide, "the row quantiser")
    m = x.shape[0]
    rows = -(-m // row_multiple) * row_multiple
    q = torch.empty(rows, width, dtype=dtype)
    scale = torch.empty(m, 1, dtype=torch.float32)
    _run_quantiser(x, k, x_bound, "u8" if dtype == torch.uint8 else "i16",
                   (q.data_ptr(), width, scale.data_ptr(), int(wide), torch.get_num_threads()), prologue)
    if rows == m:  # no padding rows (a fill and a view cost ~7 us a call, ~120 calls a forward)
        return q, scale
    q[m:] = pad
    return q[:m], scale


MAX_DIGITS = 3  # quantize.h kMaxDigits: 21-bit integers, beyond every bound the kernels take


def quantize_digits(x: torch.Tensor, k: int, x_bound: int, passes: int, q: torch.Tensor, wide: bool | None = None,
                    prologue: Prologue = None) -> torch.Tensor:
    """The library's row quantiser on x (M, K), its integers split into `passes` base-128 digits
    (split_digits', most significant first) written into q (passes, MP >= M, LDQ >= K) int8, digit t
    of row r at q[t, r], the columns K..LDQ zero (rows M..MP untouched) -> the row scales (M, 1)
    float32. wide and prologue: as _quantize_rows (the same integers whichever width or pass)."""
    wide = wide_lanes(wide, "the digits' quantiser")
    m = x.shape[0]
    if not 1 <= passes <= MAX_DIGITS:
        raise ValueError(f"the digits' quantiser writes 1 to {MAX_DIGITS} base-128 digits, got {passes}")
    if q.dtype != torch.int8 or q.dim() != 3 or q.shape[0] != passes or q.shape[1] < m or q.shape[2] < k \
            or not q.is_contiguous():
        raise ValueError(f"the digits go into a contiguous ({passes}, >= {m}, >= {k}) int8 buffer, got "
                         f"{tuple(q.shape)} {q.dtype}")
    scale = torch.empty(m, 1, dtype=torch.float32)
    _run_quantiser(x, k, x_bound, "digits", (passes, q.data_ptr(), q.shape[2], q.shape[1], scale.data_ptr(), int(wide),
                                              torch.get_num_threads()), prologue)
    return scale


def hadamard_block_fits(block: int, k: int) -> bool:
    """Whether the library's Hadamard pass takes this block on k-wide rows: 0 (none), or a power of two
    dividing k."""
    return block == 0 or (block > 0 and block & (block - 1) == 0 and k % block == 0)


def _run_quantiser(x: torch.Tensor, k: int, x_bound: int, kind: str, tail: tuple, prologue: Prologue) -> None:
    """Calls the library's quantiser of `kind` ("i16", "u8" or "digits") on x, or its form with the
    prologue's row pass in front; tail: that quantiser's arguments after the bound."""
    x, lib = x.float().contiguous(), _library()
    m = x.shape[0]
    if prologue is None:
        name = {"i16": "prism_quantize_rows", "u8": "prism_quantize_rows_u8", "digits": "prism_quantize_rows_digits"}
        getattr(lib, name[kind])(x.data_ptr(), m, k, x_bound, *tail)
    elif isinstance(prologue, RmsNorm):
        weight = prologue.weight.float().contiguous()
        if x.shape[1] != k or weight.shape != (k,):
            raise ValueError(f"RMSNorm in front of a {k}-wide quantiser needs x (M, {k}) and weight ({k},), got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        getattr(lib, f"prism_rms_norm_quantize_{kind}")(x.data_ptr(), m, k, weight.data_ptr(), prologue.eps, x_bound,
                                                        *tail)
    else:
        block, glu = prologue.hadamard_block, isinstance(prologue, SwiGLU)
        name = "SwiGLU" if glu else "The Hadamard"
        if x.shape[1] != (2 * k if glu else k) or not hadamard_block_fits(block, k) or (not glu and not block):
            raise ValueError(f"{name} in front of a {k}-wide quantiser needs x (M, {2 * k if glu else k}) and a "
                             f"Hadamard block that is {'0 or ' if glu else ''}a power of two dividing {k}, got "
                             f"{tuple(x.shape)}, block {block}")
        getattr(lib, f"prism_{'swiglu' if glu else 'hadamard'}_quantize_{kind}")(x.data_ptr(), m, k, block, x_bound,
                                                                                 *tail)


class _Epilogue:
    """The kernels' epilogue operands: float32 x_scale (M,), w_scale (N,), bias (N,) or None, residual
    (M, N) or None (added last: the decoder's skip connection), or none at all (raw float64 sums).
    Holds the contiguous copies alive while the library reads their pointers."""

    def __init__(self, m: int, n: int, x_scale, w_scale, bias, residual):
        if residual is not None and (x_scale is None or residual.shape != (m, n)):
            raise ValueError(f"a residual is added to the dequantised ({m}, {n}) output only, got "
                             f"{tuple(residual.shape)}{'' if x_scale is not None else ' without scales'}")
        self.tensors = [] if x_scale is None else [
            x_scale.reshape(m).float().contiguous(), w_scale.float().contiguous(),
            None if bias is None else bias.float().contiguous(),
            None if residual is None else residual.float().contiguous()]
        self.pointers = [None if t is None else t.data_ptr() for t in self.tensors] or [None] * 4


def _epilogue(m: int, n: int, x_scale, w_scale, bias, residual=None) -> tuple[torch.Tensor, _Epilogue]:
    """The output tensor ((M, N) float32 dequantised, or float64 raw sums without scales) and the
    epilogue operands of one kernel call."""
    dtype = torch.float64 if x_scale is None else torch.float32
    return torch.empty(m, n, dtype=dtype), _Epilogue(m, n, x_scale, w_scale, bias, residual)


def _rotary_arguments(rotary: Rotary | None, m: int, n: int, x_scale) -> tuple:
    """The VNNI kernels' (cos, sin, rotary_cols) for one call, checked: (None, None, 0) without rotary."""
    if rotary is None:
        return None, None, 0
    cos, sin = rotary.cos, rotary.sin
    if x_scale is None or rotary.columns % ROTARY_HEAD or not 0 < rotary.columns <= n or \
            cos.shape != (m, ROTARY_HEAD) or sin.shape != (m, ROTARY_HEAD) or \
            cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"the rotary epilogue takes a dequantised output, heads of {ROTARY_HEAD} columns up to "
                         f"{n}, and contiguous float32 cos, sin ({m}, {ROTARY_HEAD}); got columns {rotary.columns}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    return cos.data_ptr(), sin.data_ptr(), rotary.columns


def _split_output(split: int, m: int, n: int, x_scale, residual) -> torch.Tensor | None:
    """The VNNI kernels' second output, columns [split, N) of a dequantised product in their own
    (M, N - split) float32 tensor (a qkv projection's keys and values: the forward keeps them without
    copying them out of the product), checked; None without split."""
    if not split:
        return None
    if x_scale is None or residual is not None or split % ROTARY_HEAD or not 0 < split < n:
        raise ValueError(f"a split output takes a dequantised product without residual, split at a multiple of "
                         f"{ROTARY_HEAD} below {n}; got split {split}{'' if x_scale is not None else ' without scales'}"
                         f"{' with a residual' if residual is not None else ''}")
    return torch.empty(m, n - split, dtype=torch.float32)


class PackedWeight:
    """An integer weight W (K, N), |W| <= w_bound < 2^15, packed into the int16 kernel's panels: for
    the AVX2 kernel (vpmaddwd), or with `vnni` for its AVX-512 VNNI form (vpdpwssd; the same panels,
    operands and exact int32 runs, twice the products per instruction and no separate addition)."""

    def __init__(self, w_int: torch.Tensor, w_bound: int, vnni: bool = False):
        """w_int: (K, N) integer-valued tensor."""
        k, n = w_int.shape
        self.k, self.n, self.w_bound, self.vnni = k, n, w_bound, vnni
        self.kpairs, panels = (k + 1) // 2, -(-n // PANEL)
        padded = torch.zeros(2 * self.kpairs, panels * PANEL, dtype=torch.int16)
        padded[:k, :n] = w_int.to(torch.int16)
        # (2*kpairs, panels*16) -> (panels, kpairs, 16, 2): a k-pair of one column is adjacent
        self.packed = padded.view(self.kpairs, 2, panels, PANEL).permute(2, 0, 3, 1).contiguous()
        # (2*kpairs,) int32: max over the columns of |W[k]|, which bounds the kernel's int32 runs
        self.row_max = padded.abs().amax(dim=1).to(torch.int32).contiguous()

    def unpacked(self) -> torch.Tensor:
        """W again, (K, N) int16 (for the int8 digits the Triton-lang kernel takes)."""
        panels = self.packed.shape[0]
        return self.packed.permute(1, 3, 0, 2).reshape(2 * self.kpairs, panels * PANEL)[: self.k, : self.n]

    def quantize(self, x: torch.Tensor, x_bound: int,
                 prologue: Prologue = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (M, K) float32 -> its per-row integers as the kernel's int16 operand (M, 2 * kpairs)
        and the row scales (M, 1) float32: quant.py's symmetric rounding in one pass, same bits.
        prologue: the integers of that row pass over x, in the same pass (_quantize_rows)."""
        return _quantize_rows(x, self.k, x_bound, 2 * self.kpairs, torch.int16, prologue=prologue)

    def matmul(self, x_int: torch.Tensor, x_bound: int, x_scale: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, rotary: Rotary | None = None,
               split: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x_int: (M, K) integer-valued, |x_int| <= x_bound, or quantize()'s int16 operand. Without
        scales -> (M, N) float64, exactly x_int @ W; with x_scale (M, 1) and w_scale (N,) float32 ->
        (M, N) float32, the dequantised ((X @ W) * x_scale) * w_scale rounded once, plus bias (N,), plus
        residual (M, N) last where given (the decoder's skip connection, fused: one pass fewer).
        rotary (the VNNI form only, with scales): then the rotary embedding of its columns' heads
        (prologues.Rotary), the bits of rowwise.rotary on that output. split (the VNNI form only, with
        scales, a multiple of 64, no residual): -> (columns [0, split) (M, split), columns [split, N)
        (M, N - split)), each in its own storage, the same bits as the two slices of the (M, N) output."""
        lib = _library()
        if not fits(x_bound, self.w_bound):
            raise ValueError(f"integers up to {x_bound} x {self.w_bound} do not fit the int16 kernel")
        if self.vnni and not has_avx512_vnni():
            raise RuntimeError("the int16 kernel's VNNI form needs a CPU with AVX-512 VNNI")
        m = x_int.shape[0]
        x16 = x_int if x_int.dtype == torch.int16 and x_int.shape[1] == 2 * self.kpairs else x_int.to(torch.int16)
        if x16.shape[1] != 2 * self.kpairs:
            x16 = torch.nn.functional.pad(x16, (0, 1))
        x16 = x16.contiguous()
        if (rotary is not None or split) and not self.vnni:
            raise ValueError("the int16 kernel has no rotary epilogue or split output (its VNNI form has)")
        rest = _split_output(split, m, self.n, x_scale, residual)
        out, epilogue = _epilogue(m, split or self.n, x_scale, w_scale, bias, residual)
        arguments = (x16.data_ptr(), m, self.kpairs, self.packed.data_ptr(), self.row_max.data_ptr(), self.n,
                     chunk_pairs(x_bound, self.w_bound), *epilogue.pointers, out.data_ptr(), torch.get_num_threads())
        if self.vnni:
            lib.prism_vnni16_gemm(*arguments, *_rotary_arguments(rotary, m, self.n, x_scale),
                                  None if rest is None else rest.data_ptr(), split)
        else:
            lib.prism_int16_gemm(*arguments)
        return out if rest is None else (out, rest)


VNNI_PANEL = 32  # output columns per packed panel of the 8-bit kernel (NR8 in the source)
VNNI_ZERO_POINT = 128  # activations enter vpdpbusd as q + 128 (its unsigned operand)
VNNI_MAX_K = (INT32_MAX // (255 * 127)) // 4 * 4  # the longest K whose lane sums cannot overflow int32
GLU_COLUMNS = 16  # gate (and up) columns per panel of the 8-bit kernel with its SwiGLU epilogue


def fits8(x_bound: int, w_bound: int, k: int = 0) -> bool:
    """Whether integers of these bounds, over K = k, can use the 8-bit kernel (8-bit operands, int32
    lanes that cannot overflow)."""
    return max(x_bound, w_bound) <= 127 and k <= VNNI_MAX_K


def vnni8_available() -> bool:
    """Whether the 8-bit kernel runs here: the library loads and the CPU has AVX-512 VNNI."""
    return has_avx512_vnni() and load() is not None


_amx_error: int | None = None  # prism_amx_init's answer, asked once per process


def amx8_available() -> bool:
    """Whether the 8-bit kernel's AMX variant runs here: a CPU with AMX int8 tiles, the library, and
    Linux's permission for this process to use the tiles (arch_prctl, asked once)."""
    global _amx_error
    if not (has_amx_int8() and load() is not None):
        return False
    if _amx_error is None:
        _amx_error = _library().prism_amx_init()
    return _amx_error == 0


AMX_K, AMX_ROWS = 64, 16  # an AMX tile multiplies 16 rows by 64 k at a time: the operands are padded to them


class PackedWeight8:
    """An 8-bit integer weight W (K, N), |W| <= 127, packed for the AVX-512 VNNI kernel: panels of 32
    columns, each k-quad of a column adjacent (vpdpbusd's 4 bytes per int32 lane). With `amx`, for
    the same kernel on AMX tiles (the same layout, K padded to a multiple of 64). With `glu`, W is
    gate_proj's and up_proj's weights side by side (N = 2 I, gate first) and each panel holds 16 gate
    columns and the matching 16 up columns, so the kernel (VNNI or AMX) can end in SwiGLU (matmul(swiglu=True))."""

    def __init__(self, w_int: torch.Tensor, amx: bool = False, glu: bool = False):
        """w_int: (K, N) integer-valued tensor, |w_int| <= 127, K <= VNNI_MAX_K; N a multiple of 32 with glu."""
        k, n = w_int.shape
        if not fits8(127, 127, k):
            raise ValueError(f"K = {k} is beyond the 8-bit kernel's int32 bound ({VNNI_MAX_K})")
        if glu and n % (2 * GLU_COLUMNS):
            raise ValueError(f"the SwiGLU epilogue needs N a multiple of {2 * GLU_COLUMNS}, got N = {n}")
        self.k, self.n, self.amx = k, n, amx
        # column order of the packed panels: with glu, panel p = gate 16p..16p+15, then up I+16p..I+16p+15
        self.order = torch.arange(n).view(2, n // (2 * GLU_COLUMNS), GLU_COLUMNS).transpose(0, 1).reshape(-1) \
            if glu else None
        if glu:
            w_int = w_int[:, self.order]
        k_multiple = AMX_K if amx else 4
        self.kquads, panels = -(-k // k_multiple) * k_multiple // 4, -(-n // VNNI_PANEL)
        padded = torch.zeros(4 * self.kquads, panels * VNNI_PANEL, dtype=torch.int8)
        padded[:k, :n] = w_int.to(torch.int8)
        # (4*kquads, panels*32) -> (panels, kquads, 32, 4): the four k of a column's int32 lane are adjacent
        self.packed = padded.view(self.kquads, 4, panels, VNNI_PANEL).permute(2, 0, 3, 1).contiguous()
        # (panels*32,) int32: what the zero point adds to every output of column c
        self.correction = (VNNI_ZERO_POINT * padded.sum(dim=0, dtype=torch.int32)).contiguous()

    def unpacked(self) -> torch.Tensor:
        """W again, (K, N) int8 (for the int8 digits the Triton-lang kernel takes), in its own column order."""
        panels = self.packed.shape[0]
        packed_order = self.packed.permute(1, 3, 0, 2).reshape(4 * self.kquads, panels * VNNI_PANEL)[: self.k, : self.n]
        if self.order is None:
            return packed_order
        w = torch.empty_like(packed_order)
        w[:, self.order] = packed_order
        return w

    def quantize(self, x: torch.Tensor, x_bound: int,
                 prologue: Prologue = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (M, K) float32 -> its per-row integers + 128 as the kernel's uint8 operand (M, 4 * kquads)
        and the row scales (M, 1) float32: quant.py's symmetric rounding, same integers and scales.
        prologue: the integers of that row pass over x, in the same pass (_quantize_rows)."""
        if x_bound > 127:
            raise ValueError(f"the 8-bit kernel takes integers up to 127, not {x_bound}")
        return _quantize_rows(x, self.k, x_bound, 4 * self.kquads, torch.uint8, AMX_ROWS if self.amx else 1,
                              VNNI_ZERO_POINT, prologue=prologue)

    @staticmethod
    def _padded_rows(xu: torch.Tensor) -> torch.Tensor:
        """The AMX kernel reads whole tiles of 16 rows: xu (M, width) as a view of the first M rows of
        a buffer whose rows up to a multiple of 16 hold 128 (zeros); xu itself where it already is one."""
        m, width = xu.shape
        rows = -(-m // AMX_ROWS) * AMX_ROWS
        if xu.is_contiguous() and xu.storage_offset() == 0 and xu.untyped_storage().nbytes() >= rows * width:
            return xu
        padded = torch.full((rows, width), VNNI_ZERO_POINT, dtype=torch.uint8)
        padded[:m] = xu
        return padded[:m]

    def matmul(self, x_int: torch.Tensor, x_bound: int = 127, x_scale: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, swiglu: bool = False, rotary: Rotary | None = None,
               split: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x_int: (M, K) integer-valued, |x_int| <= x_bound <= 127, or quantize()'s uint8 operand. Without scales ->
        (M, N) float64, exactly x_int @ W; with x_scale (M, 1) and w_scale (N,) -> (M, N) float32, the
        dequantised ((X @ W) * x_scale) * w_scale rounded once, plus bias (N,): PackedWeight.matmul's contract.
        swiglu (a weight packed with glu; scales, no residual): -> (M, N / 2) float32, silu(gate) * up of
        that output's two halves, in the kernel's epilogue: the bits of rowwise.swiglu applied to it.
        rotary, split (the VNNI kernel only; scales, no glu): as PackedWeight.matmul's."""
        lib = _library()
        if (rotary is not None or split) and (self.amx or self.order is not None):
            raise ValueError("the rotary epilogue and split output are the VNNI kernel's, on a weight packed without glu")
        if swiglu and (self.order is None or x_scale is None or residual is not None):
            raise ValueError("the SwiGLU epilogue needs a weight packed with glu=True, scales and no residual")
        if not has_avx512_vnni():
            raise RuntimeError("the 8-bit kernel needs a CPU with AVX-512 VNNI")
        if x_bound > 127:
            raise ValueError(f"the 8-bit kernel takes integers up to 127, not {x_bound}")
        m = x_int.shape[0]
        if x_int.dtype == torch.uint8:
            xu = x_int
        else:  # the AMX kernel's padding rows allocated with the operand
            rows = -(-m // AMX_ROWS) * AMX_ROWS if self.amx else m
            xu = torch.full((rows, 4 * self.kquads), VNNI_ZERO_POINT, dtype=torch.uint8)[:m]
            xu[:, : self.k] = (x_int.to(torch.int16) + VNNI_ZERO_POINT).to(torch.uint8)
        xu = self._padded_rows(xu) if self.amx else xu.contiguous()
        if self.amx and not amx8_available():
            raise RuntimeError("the 8-bit kernel's AMX variant needs a CPU with AMX int8 tiles")
        if self.order is not None:  # the scales and bias in the panels' column order
            w_scale = w_scale.reshape(-1)[self.order]
            bias = None if bias is None else bias[self.order]
            residual = None if residual is None else residual[:, self.order]
        # with SwiGLU the kernel writes silu(gate) * up: half the columns (no (M, N) buffer to allocate)
        rest = _split_output(split, m, self.n, x_scale, residual)
        out, epilogue = _epilogue(m, self.n // 2 if swiglu else split or self.n, x_scale, w_scale, bias, residual)
        arguments = (xu.data_ptr(), m, self.kquads, self.packed.data_ptr(), self.correction.data_ptr(), self.n,
                     *epilogue.pointers, out.data_ptr(), torch.get_num_threads(), int(swiglu))
        if self.amx:
            lib.prism_amx8_gemm(*arguments)
        else:
            lib.prism_vnni8_gemm(*arguments, *_rotary_arguments(rotary, m, self.n, x_scale),
                                 None if rest is None else rest.data_ptr(), split)
        if rest is not None:
            return out, rest
        if self.order is None or swiglu:
            return out
        ordered = torch.empty_like(out)  # columns back in W's order
        ordered[:, self.order] = out
        return ordered


DIGIT_BASE = 128  # passes are base-128 digits, most significant first (prism_backend/model/exact_matmul.py)


def split_digits(x_int: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """Integer-valued tensor, |x_int| < 128^passes / 2 -> its base-128 digits as int8 tensors, most
    significant first (|first| <= 127, |others| <= 64); exact in float32."""
    digits, rest = [], x_int.float()
    for i in range(passes - 1, -1, -1):
        digit = torch.round(rest / DIGIT_BASE**i)  # a division by a power of two: exact
        digits.append(digit.to(torch.int8))
        rest = rest - digit * DIGIT_BASE**i
    return digits


class DigitWeight:
    """An integer weight W (K, N) as its base-128 int8 digits, multiplied by `torch._int_mm` (oneDNN's
    int8 GEMM: exact int32 sums, on AMX tiles where the CPU has them, VNNI otherwise), with this
    library's quantiser writing the activations' digits and its epilogue combining the P * Q digit
    products in int64 and dequantising: PackedWeight's contract for integers of any pass count."""

    def __init__(self, w_digits: list[torch.Tensor], act_passes: int):
        """w_digits: W's digits, (K, N) int8 each, most significant first (split_digits)."""
        self.w_digits = [d.contiguous() for d in w_digits]
        self.k, self.n = self.w_digits[0].shape
        self.act_passes = act_passes

    def quantize(self, x: torch.Tensor, x_bound: int,
                 prologue: Prologue = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (M, K) float32 -> the digits of its per-row integers, stacked (P * M, K) int8 (digit i
        in rows i*M..), and the row scales (M, 1) float32: quant.py's quantisation and int8_passes.
        prologue: the digits of that row pass over x, in the same pass (quantize_digits)."""
        digits = torch.empty(self.act_passes, x.shape[0], self.k, dtype=torch.int8)
        scale = quantize_digits(x, self.k, x_bound, self.act_passes, digits, prologue=prologue)
        return digits.view(-1, self.k), scale

    def matmul(self, x_int: torch.Tensor, x_bound: int, x_scale: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x_int: quantize()'s stacked int8 digits, or (M, K) integer-valued, |x_int| <= x_bound.
        Without scales -> (M, N) float64, exactly x_int @ W; with x_scale (M, 1) and w_scale (N,) ->
        (M, N) float32, ((X @ W) * x_scale) * w_scale rounded once, plus bias (N,)."""
        if x_int.dtype == torch.int8:
            digits = x_int.contiguous()
        else:
            digits = torch.cat(split_digits(x_int, self.act_passes))
        m = digits.shape[0] // self.act_passes
        # (P * M, N) int32 each, exact; one product per weight digit over all activation digits (row
        # blocks sized for L2 measured slower: oneDNN's own blocking does better on the whole)
        products = [torch._int_mm(digits, w) for w in self.w_digits]
        pointers = (ctypes.c_void_p * len(products))(*[p.data_ptr() for p in products])
        out, epilogue = _epilogue(m, self.n, x_scale, w_scale, bias, residual)
        _library().prism_combine_digits(pointers, m, self.n, self.act_passes, len(products), *epilogue.pointers,
                                        out.data_ptr(), torch.get_num_threads())
        return out


class AmxDigitWeight:
    """An integer weight W (K, N) of one or two base-128 digits (up to 13 bits) for the AMX digits
    kernel: each digit packed like PackedWeight8's AMX panels; activations of one or two digits,
    quantised by the library straight into the kernel's padded layout. PackedWeight's contract."""

    MAX_PASSES = 2

    def __init__(self, w_digits: list[torch.Tensor], act_passes: int):
        """w_digits: W's digits, (K, N) int8 each, most significant first (split_digits)."""
        if not (len(w_digits) <= self.MAX_PASSES and act_passes <= self.MAX_PASSES):
            raise ValueError(f"the AMX digits kernel takes up to {self.MAX_PASSES} digits a side")
        self.k, self.n = w_digits[0].shape
        self.act_passes = act_passes
        # only the packed panels are kept: the (K, N) digits besides them were a second copy of every
        # 13-bit weight (81 MB of a replica for SmolLM2's qkv and down_proj, 2026-12-05)
        self.panels = [PackedWeight8(d, amx=True) for d in w_digits]
        self.kquads = self.panels[0].kquads
        self._pointers = (ctypes.c_void_p * len(self.panels))(*[p.packed.data_ptr() for p in self.panels])

    def unpacked(self) -> torch.Tensor:
        """W again, (K, N) int32 (from the panels)."""
        digits = [p.unpacked() for p in self.panels]
        return sum(d.int() * DIGIT_BASE ** (len(digits) - 1 - j) for j, d in enumerate(digits))

    def _buffer(self, m: int) -> torch.Tensor:
        """(P, rows up to a multiple of 16, 4 * kquads) int8, the rows from m on zero: the kernel's
        activation operand (rows 0..m are the quantiser's to write, their padding columns included)."""
        q = torch.empty(self.act_passes, -(-m // AMX_ROWS) * AMX_ROWS, 4 * self.kquads, dtype=torch.int8)
        q[:, m:] = 0
        return q

    def quantize(self, x: torch.Tensor, x_bound: int,
                 prologue: Prologue = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (M, K) float32 -> the digits of its per-row integers, (P, M, 4 * kquads) int8 (a view of
        the kernel's padded buffer), and the row scales (M, 1) float32: quant.py's quantisation.
        prologue: the digits of that row pass over x, in the same pass (quantize_digits)."""
        m = x.shape[0]
        q = self._buffer(m)
        scale = quantize_digits(x, self.k, x_bound, self.act_passes, q, prologue=prologue)
        return q[:, :m], scale

    def matmul(self, x_int: torch.Tensor, x_bound: int, x_scale: torch.Tensor | None = None,
               w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x_int: quantize()'s digits, or (M, K) integer-valued, |x_int| <= x_bound. Without scales ->
        (M, N) float64, exactly x_int @ W; with x_scale (M, 1) and w_scale (N,) -> (M, N) float32,
        ((X @ W) * x_scale) * w_scale rounded once, plus bias (N,)."""
        if not amx8_available():
            raise RuntimeError("the AMX digits kernel needs a CPU with AMX int8 tiles")
        if x_int.dtype == torch.int8 and x_int.dim() == 3:
            m, q = x_int.shape[1], x_int
            if q.stride(1) != 4 * self.kquads or q.stride(0) % q.stride(1) or q.stride(0) // q.stride(1) % AMX_ROWS:
                raise ValueError("pass quantize()'s operand, or the integers themselves")
        else:
            m = x_int.shape[0]
            q = self._buffer(m)
            q[:, :m, self.k :] = 0  # K's padding
            for t, digit in enumerate(split_digits(x_int, self.act_passes)):
                q[t, :m, : self.k] = digit
        mp = q.stride(0) // q.stride(1)
        out, epilogue = _epilogue(m, self.n, x_scale, w_scale, bias, residual)
        _library().prism_amx_digits_gemm(q.data_ptr(), m, mp, self.kquads, self.act_passes, self._pointers,
                                         len(self.panels), self.n, *epilogue.pointers, out.data_ptr(),
                                         torch.get_num_threads())
        return out
