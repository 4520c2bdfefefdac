"""The exact CPU GEMMs (kernels/cpu/exact_gemm.py, C++ in kernels/cpu/csrc/exact_gemm.cpp), the int16
kernel (AVX2, and its AVX-512 VNNI form) and the AVX-512 VNNI 8-bit one, against their torch
reference, the float64 product of the same integers: exact at the bounds, for awkward shapes, at any thread count, with their fused
quantisation and dequantisation giving the bits of the unfused torch code, and built once into the
library's cache."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu import exact_gemm
from kernels.cpu.exact_gemm import PackedWeight, PackedWeight8, chunk_pairs, fits
from kernels.cpu.features import has_avx512
from prism_backend.model.exact_matmul import dequantize, int_bound
from prism_backend.reproducibility import torch_threads

from helpers import needs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = needs("avx2")  # the int16 kernel is for x86 CPUs with AVX2


@pytest.fixture(params=[False, pytest.param(True, marks=needs("avx512_vnni"))], ids=["avx2", "vnni16"])
def vnni(request) -> bool:
    """The int16 kernel's two forms: AVX2 (vpmaddwd) and AVX-512 VNNI (vpdpwssd, where the CPU has it)."""
    return request.param


def extreme_integers(m: int, k: int, n: int, xb: int, wb: int, seed: int = 0):
    """Random integers within the bounds, with rows/columns that make every product the largest
    possible (+ and -): the sums an int32 chunk must hold without overflow."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-xb, xb + 1, (m, k), generator=gen).float()
    w = torch.randint(-wb, wb + 1, (k, n), generator=gen).float()
    x[0], w[:, 0] = xb, wb
    if m > 1:
        x[1] = -xb
    if n > 1:
        w[:, 1] = -wb
    return x, w


def test_the_kernel_builds_on_this_machine():
    """CI machines are AVX2 x86 with g++: the route must really be there, not silently skipped."""
    assert exact_gemm.load() is not None, exact_gemm.why_not()


# n: panels of 16 in tiles of 4 on vnni16 -- whole tiles (576, 192) and a last tile of 1, 2 or 3 (1537, 17, 40)
@pytest.mark.parametrize("m, k, n", [(1, 576, 576), (5, 577, 17), (6, 2, 16), (7, 1536, 192), (37, 1100, 1537),
                                     (13, 31, 3), (11, 577, 40)])
@pytest.mark.parametrize("passes", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_exact_at_the_bounds(m, k, n, passes, vnni):
    xb, wb = int_bound(passes[0]), int_bound(passes[1])
    x, w = extreme_integers(m, k, n, xb, wb, seed=m * k + n)
    got = PackedWeight(w, wb, vnni=vnni).matmul(x, xb)
    assert got.dtype == torch.float64 and torch.equal(got, x.double() @ w.double())
    assert got[0, 0] == k * xb * wb  # the largest possible sum really was computed


def raw_product(x: torch.Tensor, packed: PackedWeight, block: int, row_max: torch.Tensor | None = None):
    """The library's float64 product with a chosen block and column maxima (the overflow guards)."""
    m = x.shape[0]
    out = torch.empty(m, packed.n, dtype=torch.float64)
    x16 = torch.nn.functional.pad(x.to(torch.int16), (0, 2 * packed.kpairs - x.shape[1])).contiguous()
    row_max = packed.row_max if row_max is None else row_max
    lib = exact_gemm.load()
    arguments = (x16.data_ptr(), m, packed.kpairs, packed.packed.data_ptr(), row_max.data_ptr(), packed.n, block,
                 None, None, None, None, out.data_ptr(), 1)
    if packed.vnni:
        lib.prism_vnni16_gemm(*arguments, None, None, 0, None, 0)  # no rotary epilogue, no split output
    else:
        lib.prism_int16_gemm(*arguments)
    return out


def test_the_block_is_what_keeps_int32_exact_at_the_bounds(vnni):
    """The block is the largest that cannot overflow, and one more k-pair per block does overflow:
    at the bounds the widening to float64 after every block is what makes 13-bit x 13-bit exact."""
    xb = wb = int_bound(2)
    block = chunk_pairs(xb, wb)
    assert 2 * block * xb * wb <= 2**31 - 1 < 2 * (block + 1) * xb * wb
    x, w = extreme_integers(3, 4 * block + 6, 20, xb, wb)
    packed = PackedWeight(w, wb, vnni=vnni)
    assert torch.equal(raw_product(x, packed, block), x.double() @ w.double())
    assert raw_product(x, packed, block + 1)[0, 0] != x[0].double() @ w[:, 0].double()


def typical_integers(m: int, k: int, n: int, seed: int = 0):
    """13-bit integers shaped like a decoder's: most |x| in the low hundreds, a few outlier
    channels at the bound, weights per column scaled to 8191 at their largest."""
    gen = torch.Generator().manual_seed(seed)
    bound = int_bound(2)
    x = (torch.randn(m, k, generator=gen) * 300).round().clamp(-bound, bound)
    x[:, torch.randperm(k, generator=gen)[:3]] = bound
    w = torch.randn(k, n, generator=gen)
    w = (w / w.abs().amax(dim=0) * bound).round()
    return x, w


def test_runs_span_many_blocks_where_the_data_allows(vnni):
    """On typical integers the kernel sums runs of many blocks in int32 (so it widens rarely),
    exactly: with column maxima that claim W is zero it overflows, so the runs really are guarded by
    the data's own bound, not by the worst case."""
    x, w = typical_integers(7, 1536, 40)
    x = (x * 2).clamp(-int_bound(2), int_bound(2))
    w[:, 0] = torch.where(x[0] < 0, -int_bound(2), int_bound(2))  # row 0 x column 0 adds up |x| * 8191
    packed = PackedWeight(w, int_bound(2), vnni=vnni)
    block = chunk_pairs(int_bound(2), int_bound(2))
    exact = x.double() @ w.double()
    bound = (x.abs().double() @ w.abs().amax(dim=1).double())  # (m,): what a whole-K run would need
    assert (bound > 2**31).all() and (bound < 8 * 2**31).all()  # several runs, far fewer than blocks
    assert torch.equal(raw_product(x, packed, block), exact)
    unguarded = raw_product(x, packed, block, torch.zeros_like(packed.row_max))
    assert not torch.equal(unguarded, exact)


@pytest.mark.parametrize("seed", range(4))
def test_runs_are_exact_when_rows_of_a_tile_differ(seed, vnni):
    """A tile's run ends where its largest row needs it to: small rows next to rows at the bound,
    and rows whose bound sits just below or just above 2^31 at a block boundary."""
    xb = wb = int_bound(2)
    block = chunk_pairs(xb, wb)
    x, w = typical_integers(11, 64 * block + 10, 33, seed)
    w[:, 0] = wb
    x[seed % 3] = xb  # a worst-case row in one of the first tile's rows
    x[4, : 2 * block * 4] = xb  # four worst-case blocks, then typical values
    per_k = 2**31 // (2 * block * wb * 5)  # a constant row whose 5-block run sums to just below 2^31
    x[7] = per_k
    x[8] = per_k + 1  # ... and just above it
    packed = PackedWeight(w, wb, vnni=vnni)
    assert torch.equal(packed.matmul(x, xb), x.double() @ w.double())


def test_fits():
    assert fits(int_bound(2), int_bound(2)) and fits(127, 127)
    assert not fits(int_bound(3), int_bound(2))  # three activation passes: the float route


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m, k, n", [(1, 576, 1536), (37, 577, 19), (760, 1536, 576)])
def test_fused_dequantisation_equals_the_torch_epilogue(m, k, n, bias, vnni):
    xb = wb = int_bound(2)
    x, w = extreme_integers(m, k, n, xb, wb, seed=k)
    gen = torch.Generator().manual_seed(1)
    x_scale = torch.rand(m, 1, generator=gen) * 1e-3
    w_scale = torch.rand(n, generator=gen) * 1e-4
    b = torch.randn(n, generator=gen) if bias else None
    packed = PackedWeight(w, wb, vnni=vnni)
    fused = packed.matmul(x, xb, x_scale, w_scale, b)
    assert fused.dtype == torch.float32
    assert torch.equal(fused, dequantize(packed.matmul(x, xb), x_scale, w_scale, b))


@pytest.mark.parametrize("m", [1, 5, 6, 7, 760])
def test_rows_and_thread_counts_cannot_change_a_bit(m, vnni):
    xb = wb = int_bound(2)
    x, w = extreme_integers(760, 1537, 577, xb, wb, seed=m)
    x_scale, w_scale = torch.rand(760, 1) * 1e-3, torch.rand(577) * 1e-4
    packed = PackedWeight(w, wb, vnni=vnni)
    with torch_threads(1):
        full = packed.matmul(x, xb, x_scale, w_scale, None)
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            rows = packed.matmul(x[:m], xb, x_scale[:m], w_scale, None)
        assert torch.equal(rows, full[:m]), threads


def test_built_once_into_its_package(tmp_path):
    """A fresh copy of the kernels package, with empty user caches: the first process compiles into
    kernels/cpu/lib/ (what an export carries), the next one loads that file without building."""
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__", "lib"))
    code = "from kernels.cpu import exact_gemm as k; assert k.load() is not None, k.why_not(); print(k._build())"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("PRISM_KERNEL_CACHE", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    built = Path(first.strip())
    assert built.parent == tmp_path / "kernels" / "cpu" / "lib" and built.exists()
    mtime = built.stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert second == first and built.stat().st_mtime_ns == mtime
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no partial files left
    assert not (tmp_path / "xdg").exists()
    ctypes.CDLL(str(built))  # a loadable library


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("m, k", [(1, 576), (7, 577), (33, 1536), (3, 5)])
def test_quantisation_equals_the_torch_one(m, k, passes):
    """The kernel's one-pass row quantisation gives quant.py's integers and scales, bit for bit:
    ties at .5 (round half to even), an all-zero row, tiny and huge rows, outlier channels."""
    from prism_backend.model.exact_matmul import ExactWeight
    from prism_backend.model.exact_matmul import round_to_grid, symmetric_scale

    bound = int_bound(passes)
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 9, k)
    x[0, :4] = torch.tensor([2.5, -2.5, 3.5, 0.5]) * (x[0].abs().max() / bound)  # exact ties after the division
    if m > 2:
        x[1] = 0.0
        x[2] *= 1e-30
    packed = PackedWeight(torch.zeros(k, 3), bound)
    x16, scale = packed.quantize(x, bound)
    ref_scale = symmetric_scale(x.abs().amax(dim=1, keepdim=True), bound)
    ref = round_to_grid(x, ref_scale, bound)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x16[:, :k].float(), ref) and not x16[:, k:].any()
    assert ExactWeight(torch.zeros(k, 3), passes, passes, "int16").route == "int16"


def test_unpacked_gives_the_weight_back():
    """The Triton-lang kernel's int8 digits are made from the packed copy (no second copy of W is kept)."""
    _, w = extreme_integers(3, 577, 37, 1, int_bound(2))
    assert torch.equal(PackedWeight(w, int_bound(2)).unpacked(), w.to(torch.int16))


# ---- the 8-bit kernel (AVX-512 VNNI): one activation pass x one weight pass ----------------------
needs_vnni = needs("avx512_vnni")


def test_the_8_bit_kernel_is_a_route_exactly_where_the_cpu_runs_it():
    """Where the CPU has AVX-512 VNNI the 8-bit kernel is available and a candidate for one pass a
    side (never for more); elsewhere it is no candidate and forcing it is an error, not a crash."""
    from prism_backend.model import exact_matmul

    here = exact_gemm.has_avx512_vnni()
    assert exact_gemm.vnni8_available() == here
    assert exact_matmul.runs_here("vnni8", 127, 127) == here
    assert not exact_matmul.runs_here("vnni8", int_bound(2), 127)
    assert not exact_matmul.runs_here("vnni8", 127, int_bound(2))
    assert exact_matmul.runs_here("vnni16", int_bound(2), int_bound(2)) == here  # the int16 kernel's VNNI form
    if here:  # a forced 8-bit route for two passes takes the next exact kernel
        assert exact_matmul.ExactWeight(torch.zeros(8, 3), 2, 2, "vnni8").route == "int16"
        assert exact_matmul.ExactWeight(torch.zeros(8, 3), 1, 1, "vnni8").route == "vnni8"


@needs_vnni
@pytest.mark.parametrize("m, k, n", [(1, 576, 576), (5, 577, 17), (8, 2, 32), (9, 1536, 192), (37, 1100, 1537),
                                     (13, 31, 3)])
def test_8_bit_kernel_exact_at_the_bounds(m, k, n):
    x, w = extreme_integers(m, k, n, 127, 127, seed=m * k + n)
    packed = PackedWeight8(w)
    got = packed.matmul(x, 127)
    assert got.dtype == torch.float64 and torch.equal(got, x.double() @ w.double())
    assert got[0, 0] == k * 127 * 127 and torch.equal(packed.unpacked().float(), w)


@needs_vnni
def test_8_bit_kernel_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError):
        PackedWeight8(torch.zeros(exact_gemm.VNNI_MAX_K + 4, 2))
    with pytest.raises(ValueError):
        PackedWeight8(torch.zeros(4, 2)).matmul(torch.zeros(1, 4), int_bound(2))


@needs_vnni  # AVX-512 (VNNI CPUs have the F/BW/VL the 16-lane quantiser uses)
@pytest.mark.parametrize("k", [5, 16, 577, 1536])
def test_the_16_lane_quantisers_give_the_8_lane_integers(k):
    """Where the CPU has AVX-512 the row quantisers run 16 lanes at a time (then 8, then the tail):
    the same per-element steps, so the integers and scales of the AVX2 width, ties included."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(9, k, generator=gen) * torch.linspace(0.1, 9, k)
    x[0, :4] = torch.tensor([2.5, -2.5, 3.5, 0.5])[: min(4, k)] * (x[0].abs().max() / 127)
    x[1] = 0.0
    for width, dtype, bound in ((-(-k // 2) * 2, torch.int16, int_bound(2)), (-(-k // 4) * 4, torch.uint8, 127)):
        wide = exact_gemm._quantize_rows(x, k, bound, width, dtype, wide=True)
        narrow = exact_gemm._quantize_rows(x, k, bound, width, dtype, wide=False)
        assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])


@needs_vnni
@pytest.mark.parametrize("m, k", [(1, 576), (7, 577), (33, 1536), (3, 5)])
def test_8_bit_quantisation_equals_the_torch_one(m, k):
    """Its operand is quant.py's 8-bit integers + 128, the padding 128 (= 0), the scales bit for bit."""
    from prism_backend.model.exact_matmul import round_to_grid, symmetric_scale

    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 9, k)
    x[0, :4] = torch.tensor([2.5, -2.5, 3.5, 0.5]) * (x[0].abs().max() / 127)
    if m > 2:
        x[1] = 0.0
    packed = PackedWeight8(torch.zeros(k, 3))
    xu, scale = packed.quantize(x, 127)
    ref_scale = symmetric_scale(x.abs().amax(dim=1, keepdim=True), 127)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(xu[:, :k].float() - 128, round_to_grid(x, ref_scale, 127))
    assert (xu[:, k:] == 128).all() and xu.shape[1] % 4 == 0


@needs_vnni
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 760])
def test_8_bit_kernel_fused_epilogue_rows_and_threads(m, bias):
    """The fused dequantisation gives the torch epilogue's bits, and neither the rows in the call nor
    the thread count changes one."""
    x, w = extreme_integers(760, 1537, 577, 127, 127, seed=m)
    gen = torch.Generator().manual_seed(m)
    x_scale, w_scale = torch.rand(760, 1, generator=gen) * 1e-2, torch.rand(577, generator=gen) * 1e-3
    b = torch.randn(577, generator=gen) if bias else None
    packed = PackedWeight8(w)
    with torch_threads(1):
        full = packed.matmul(x, 127, x_scale, w_scale, b)
    assert torch.equal(full, dequantize(x.double() @ w.double(), x_scale, w_scale, b))
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            assert torch.equal(packed.matmul(x[:m], 127, x_scale[:m], w_scale, b), full[:m]), threads



@needs_vnni
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [1, 7, 8, 9, 760])
def test_8_bit_kernel_swiglu_epilogue_is_swiglu_of_its_output(m, bias):
    """gate_up packed with glu (each panel 16 gate and the matching 16 up columns): its SwiGLU
    epilogue gives rowwise.swiglu's bits on the plain kernel's output, at any rows and thread count,
    exp inputs clamped at both ends included; the plain product of that packing (with a residual) and
    the unpacked weight are W's own, in W's column order."""
    from kernels.cpu import rowwise

    x, w = extreme_integers(760, 577, 2 * 112, 127, 127, seed=m)  # 7 panels: tiles of 2 and a last one of 1
    gen = torch.Generator().manual_seed(m)
    x_scale, w_scale = torch.rand(760, 1, generator=gen) * 1e-2, torch.rand(2 * 112, generator=gen) * 1e-3
    w_scale[:8] = 1.0  # large gate values: exp's clamped range
    b = torch.randn(2 * 112, generator=gen) if bias else None
    plain, glu = PackedWeight8(w), PackedWeight8(w, glu=True)
    assert torch.equal(glu.unpacked(), plain.unpacked())
    residual = torch.randn(760, 2 * 112, generator=gen)
    assert torch.equal(glu.matmul(x, 127, x_scale, w_scale, b, residual), plain.matmul(x, 127, x_scale, w_scale, b, residual))
    with torch_threads(1):
        expected = rowwise.swiglu(plain.matmul(x, 127, x_scale, w_scale, b))
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            assert torch.equal(glu.matmul(x[:m], 127, x_scale[:m], w_scale, b, swiglu=True), expected[:m]), threads


@needs_vnni
def test_the_swiglu_epilogue_refuses_what_it_cannot_do():
    w = torch.ones(8, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedWeight8(w, glu=True)  # 48 columns: not whole panels of 16 gate + 16 up
    x, scale = torch.ones(2, 8), torch.ones(2, 1)
    with pytest.raises(ValueError, match="glu=True"):
        PackedWeight8(torch.ones(8, 64)).matmul(x, 127, scale, torch.ones(64), swiglu=True)
    with pytest.raises(ValueError, match="no residual"):
        PackedWeight8(torch.ones(8, 64), glu=True).matmul(x, 127, scale, torch.ones(64), None, torch.ones(2, 64),
                                                          swiglu=True)


# ---- the rotary epilogue of the VNNI tiles (vnni8, vnni16): a qkv projection's queries and keys ----

@needs_vnni
@pytest.mark.parametrize("kernel", ["vnni8", "vnni16"])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 760])
def test_the_rotary_epilogue_is_rowwise_rotary_of_the_output(kernel, m):
    """With rotary, the first columns' heads of 64 come out as rowwise.rotary of the plain output (the
    bits of the separate pass after the product), the other columns untouched, at any rows and 1-4
    threads; qkv's shape (15 heads of 64: 9 query, 3 key, 3 value) with a bias, as Qwen2's. With split,
    the same bits in two tensors: the queries' columns and the keys' and values'."""
    from kernels.cpu import rowwise
    from kernels.cpu.prologues import Rotary

    bound = 127 if kernel == "vnni8" else int_bound(2)
    x, w = extreme_integers(760, 577, 960, bound, bound, seed=m)
    gen = torch.Generator().manual_seed(m)
    x_scale, w_scale = torch.rand(760, 1, generator=gen) * 1e-2, torch.rand(960, generator=gen) * 1e-3
    bias = torch.randn(960, generator=gen)
    angles = torch.rand(760, 32, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)  # (760, 64)
    packed = PackedWeight8(w) if kernel == "vnni8" else PackedWeight(w, bound, vnni=True)
    with torch_threads(1):
        plain = packed.matmul(x, bound, x_scale, w_scale, bias)
    expected = plain.clone()
    expected[:, :768] = rowwise.rotary(plain[:, :768].reshape(760, 12, 64), cos, sin).reshape(760, 768)
    assert not torch.equal(expected[:, :768], plain[:, :768]) and torch.equal(expected[:, 768:], plain[:, 768:])
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            got = packed.matmul(x[:m], bound, x_scale[:m], w_scale, bias,
                                rotary=Rotary(cos[:m].contiguous(), sin[:m].contiguous(), 768))
            queries, keys_values = packed.matmul(x[:m], bound, x_scale[:m], w_scale, bias, split=576,
                                                 rotary=Rotary(cos[:m].contiguous(), sin[:m].contiguous(), 768))
            unrotated = packed.matmul(x[:m], bound, x_scale[:m], w_scale, bias, split=640)
        assert torch.equal(got, expected[:m]), threads
        # split: the queries' and the keys' and values' columns each in their own storage, the same bits
        assert queries.shape == (m, 576) and keys_values.shape == (m, 384), threads
        assert queries.is_contiguous() and keys_values.is_contiguous()
        assert torch.equal(queries, expected[:m, :576]) and torch.equal(keys_values, expected[:m, 576:]), threads
        assert torch.equal(unrotated[0], plain[:m, :640]) and torch.equal(unrotated[1], plain[:m, 640:]), threads


@needs_vnni
def test_the_rotary_epilogue_refuses_what_it_cannot_do():
    from kernels.cpu.prologues import Rotary

    x, scale, cos = torch.ones(2, 8), torch.ones(2, 1), torch.ones(2, 64)
    with pytest.raises(ValueError, match="heads of 64"):  # not whole heads
        PackedWeight8(torch.ones(8, 128)).matmul(x, 127, scale, torch.ones(128), rotary=Rotary(cos, cos, 96))
    with pytest.raises(ValueError, match="heads of 64"):  # raw sums: nothing to rotate
        PackedWeight8(torch.ones(8, 128)).matmul(x, 127, rotary=Rotary(cos, cos, 64))
    with pytest.raises(ValueError, match="without glu"):
        PackedWeight8(torch.ones(8, 128), glu=True).matmul(x, 127, scale, torch.ones(128), rotary=Rotary(cos, cos, 64))
    with pytest.raises(ValueError, match="no rotary epilogue"):
        PackedWeight(torch.ones(8, 128), 127).matmul(x, 127, scale, torch.ones(128), rotary=Rotary(cos, cos, 64))
    with pytest.raises(ValueError, match="split at a multiple of 64"):
        PackedWeight8(torch.ones(8, 128)).matmul(x, 127, scale, torch.ones(128), split=96)
    with pytest.raises(ValueError, match="split at a multiple of 64"):  # nothing after the split
        PackedWeight(torch.ones(8, 128), 127, vnni=True).matmul(x, 127, scale, torch.ones(128), split=128)
    with pytest.raises(ValueError, match="without scales"):
        PackedWeight8(torch.ones(8, 128)).matmul(x, 127, split=64)
    with pytest.raises(ValueError, match="with a residual"):
        PackedWeight8(torch.ones(8, 128)).matmul(x, 127, scale, torch.ones(128), None, torch.ones(2, 128), split=64)
    with pytest.raises(ValueError, match="without glu"):
        PackedWeight8(torch.ones(8, 128), glu=True).matmul(x, 127, scale, torch.ones(128), split=64)
    with pytest.raises(ValueError, match="split output"):
        PackedWeight(torch.ones(8, 128), 127).matmul(x, 127, scale, torch.ones(128), split=64)

# ---- the int_mm route: torch._int_mm on base-128 digits, the library's quantiser and epilogue ----
# (sizes stay small: without VNNI torch._int_mm is a plain loop)

@pytest.mark.parametrize("passes", [1, 2, 3])
@pytest.mark.parametrize("m, k", [(1, 576), (7, 577), (33, 1536), (3, 5)])
def test_digit_quantisation_equals_the_torch_one(m, k, passes):
    """The library's quantiser writes quant.py's integers split into int8_passes' digits (stacked,
    most significant first) and the same scales, bit for bit: ties, an all-zero row, tiny rows."""
    from prism_backend.model.exact_matmul import int8_passes, round_to_grid, symmetric_scale

    bound = int_bound(passes)
    gen = torch.Generator().manual_seed(m * k + passes)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 9, k)
    x[0, :4] = torch.tensor([2.5, -2.5, 3.5, 0.5]) * (x[0].abs().max() / bound)  # exact ties after the division
    if m > 2:
        x[1] = 0.0
        x[2] *= 1e-30
    weight = exact_gemm.DigitWeight(int8_passes(torch.zeros(k, 3), 2), passes)
    digits, scale = weight.quantize(x, bound)
    ref_scale = symmetric_scale(x.abs().amax(dim=1, keepdim=True), bound)
    expected = torch.cat(int8_passes(round_to_grid(x, ref_scale, bound), passes))
    assert torch.equal(scale, ref_scale)
    assert digits.dtype == torch.int8 and torch.equal(digits, expected)
    for wide in (False, True) if has_avx512() else (False,):  # 8 or 16 lanes: the same digits
        buffer = torch.empty(passes, m, k, dtype=torch.int8)
        assert torch.equal(exact_gemm.quantize_digits(x, k, bound, passes, buffer, wide=wide), ref_scale)
        assert torch.equal(buffer.view(-1, k), expected), wide


@pytest.mark.parametrize("m, k, n", [(1, 576, 576), (5, 577, 17), (37, 1100, 193), (13, 31, 3)])
@pytest.mark.parametrize("passes", [(1, 1), (2, 2), (2, 1), (1, 2), (3, 2)])
def test_digit_products_exact_at_the_bounds(m, k, n, passes):
    from prism_backend.model.exact_matmul import int8_passes

    xb, wb = int_bound(passes[0]), int_bound(passes[1])
    x, w = extreme_integers(m, k, n, xb, wb, seed=m * k + n)
    weight = exact_gemm.DigitWeight(int8_passes(w, passes[1]), passes[0])
    for operand in (x, torch.cat(int8_passes(x, passes[0]))):  # integers, or their stacked digits
        got = weight.matmul(operand, xb)
        assert got.dtype == torch.float64 and torch.equal(got, x.double() @ w.double())
    assert got[0, 0] == k * xb * wb  # the largest possible sum really was computed


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 200])
def test_digit_epilogue_rows_and_threads(m, passes, bias):
    """The combining epilogue gives the torch epilogue's bits, and neither the rows in the call nor
    the thread count changes one."""
    from prism_backend.model.exact_matmul import int8_passes

    bound = int_bound(passes)
    x, w = extreme_integers(200, 1537, 193, bound, bound, seed=m)
    gen = torch.Generator().manual_seed(m)
    x_scale, w_scale = torch.rand(200, 1, generator=gen) * 1e-2, torch.rand(193, generator=gen) * 1e-3
    b = torch.randn(193, generator=gen) if bias else None
    weight = exact_gemm.DigitWeight(int8_passes(w, passes), passes)
    with torch_threads(1):
        full = weight.matmul(x, bound, x_scale, w_scale, b)
    assert torch.equal(full, dequantize(x.double() @ w.double(), x_scale, w_scale, b))
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            assert torch.equal(weight.matmul(x[:m], bound, x_scale[:m], w_scale, b), full[:m]), threads


# ---- the 8-bit kernel on AMX tiles (Intel Xeons with AMX int8) ------------------------------------
needs_amx = needs("amx_int8")


def test_the_amx_kernel_is_a_route_exactly_where_the_cpu_runs_it():
    from prism_backend.model import exact_matmul

    here = exact_gemm.has_amx_int8()
    assert exact_gemm.amx8_available() == here  # where the CPU has the tiles, Linux grants them
    assert exact_matmul.runs_here("amx8", 127, 127) == here
    assert not exact_matmul.runs_here("amx8", int_bound(2), 127)
    if here:  # a forced 8-bit route for two passes takes the next exact kernel
        assert exact_matmul.ExactWeight(torch.zeros(8, 3), 2, 2, "amx8").route == "int16"
        assert exact_matmul.ExactWeight(torch.zeros(8, 3), 1, 1, "amx8").route == "amx8"


@needs_amx
@pytest.mark.parametrize("m, k, n", [(1, 576, 576), (5, 577, 17), (16, 64, 32), (17, 2, 33), (33, 1536, 192),
                                     (37, 1100, 1537), (13, 31, 3)])
def test_amx_kernel_exact_at_the_bounds(m, k, n):
    """Tails of every kind: rows not a multiple of 16 (or of the 32 of a double tile), K not a
    multiple of 64, N not a multiple of the 32-column panel."""
    x, w = extreme_integers(m, k, n, 127, 127, seed=m * k + n)
    got = PackedWeight8(w, amx=True).matmul(x, 127)
    assert got.dtype == torch.float64 and torch.equal(got, x.double() @ w.double())
    assert got[0, 0] == k * 127 * 127


@needs_amx
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [1, 15, 16, 33, 760])
def test_amx_kernel_gives_the_vnni_kernels_bits_whatever_the_rows_and_threads(m, bias):
    """Quantised operand, fused epilogue and all: the AMX variant's output is the VNNI kernel's (so
    the torch epilogue's, tested above), and neither the rows in the call nor the thread count
    changes a bit."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(760, 1537, generator=gen) * torch.linspace(0.1, 9, 1537)
    _, w = extreme_integers(3, 1537, 577, 127, 127, seed=m)
    w_scale = torch.rand(577, generator=gen) * 1e-3
    b = torch.randn(577, generator=gen) if bias else None
    amx, vnni = PackedWeight8(w, amx=True), PackedWeight8(w)
    with torch_threads(1):
        (q_amx, scale), (q_vnni, vnni_scale) = amx.quantize(x, 127), vnni.quantize(x, 127)
        assert torch.equal(scale, vnni_scale) and torch.equal(q_amx[:, : q_vnni.shape[1]], q_vnni)
        full = amx.matmul(q_amx, 127, scale, w_scale, b)
        assert torch.equal(full, vnni.matmul(q_vnni, 127, scale, w_scale, b))
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            q, scale = amx.quantize(x[:m], 127)
            assert q.shape[0] == m and torch.equal(amx.matmul(q, 127, scale, w_scale, b), full[:m]), threads


@needs_amx
@pytest.mark.parametrize("m", [1, 15, 16, 33, 760])
def test_amx_kernel_swiglu_epilogue_gives_the_vnni_kernels_bits(m):
    """gate_up packed with glu on AMX tiles: its SwiGLU epilogue is the VNNI kernel's (so rowwise.swiglu
    of the plain output, tested above), whatever the rows (partial tiles of 16 and 32) and threads."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(760, 577, generator=gen) * torch.linspace(0.1, 9, 577)
    _, w = extreme_integers(3, 577, 2 * 96, 127, 127, seed=m)
    w_scale = torch.rand(2 * 96, generator=gen) * 1e-3
    w_scale[:8] = 1.0  # large gate values: exp's clamped range
    b = torch.randn(2 * 96, generator=gen)
    amx, vnni = PackedWeight8(w, amx=True, glu=True), PackedWeight8(w, glu=True)
    with torch_threads(1):
        q_vnni, scale = vnni.quantize(x, 127)
        expected = vnni.matmul(q_vnni, 127, scale, w_scale, b, swiglu=True)
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            q, scale = amx.quantize(x[:m], 127)
            assert torch.equal(amx.matmul(q, 127, scale, w_scale, b, swiglu=True), expected[:m]), threads


# ---- one or two base-128 digits a side on AMX tiles (up to 13 bits) --------------------------------

@needs_amx  # K from 768 on goes in chunks of 384 (DIGIT_CHUNK): 1100, 1536 and 1537 (a last chunk of 64) do
@pytest.mark.parametrize("m, k, n", [(1, 576, 576), (5, 577, 17), (16, 64, 32), (17, 2, 33), (33, 1536, 193),
                                     (37, 1100, 1537), (35, 1537, 40)])
@pytest.mark.parametrize("passes", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_amx_digits_kernel_exact_at_the_bounds(m, k, n, passes):
    from prism_backend.model.exact_matmul import int8_passes

    xb, wb = int_bound(passes[0]), int_bound(passes[1])
    x, w = extreme_integers(m, k, n, xb, wb, seed=m * k + n)
    weight = exact_gemm.AmxDigitWeight(int8_passes(w, passes[1]), passes[0])
    got = weight.matmul(x, xb)
    assert got.dtype == torch.float64 and torch.equal(got, x.double() @ w.double())
    assert got[0, 0] == k * xb * wb
    assert torch.equal(weight.unpacked(), w.int())


@needs_amx
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("m", [1, 15, 16, 200])
def test_amx_digits_kernel_quantises_and_dequantises_as_torch_whatever_the_rows_and_threads(m, passes, bias):
    """Its quantiser writes quant.py's digits and scales (the int_mm route's, tested above) into the
    padded layout; its epilogue gives the torch epilogue's bits; rows and threads change no bit."""
    from prism_backend.model.exact_matmul import int8_passes

    bound = int_bound(passes)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(200, 1537, generator=gen) * torch.linspace(0.1, 9, 1537)
    _, w = extreme_integers(3, 1537, 193, bound, bound, seed=m)
    w_scale = torch.rand(193, generator=gen) * 1e-3
    b = torch.randn(193, generator=gen) if bias else None
    amx = exact_gemm.AmxDigitWeight(int8_passes(w, passes), passes)
    reference = exact_gemm.DigitWeight(int8_passes(w, passes), passes)
    with torch_threads(1):
        (q, scale), (digits, ref_scale) = amx.quantize(x, bound), reference.quantize(x, bound)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q[:, :, :1537].reshape(-1, 1537), digits) and not q[:, :, 1537:].any()
        full = amx.matmul(q, bound, scale, w_scale, b)
        assert torch.equal(full, dequantize(reference.matmul(digits, bound), scale, w_scale, b))
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            q, scale = amx.quantize(x[:m], bound)
            assert q.shape[1] == m and torch.equal(amx.matmul(q, bound, scale, w_scale, b), full[:m]), threads


# ---- the residual add fused into every route's epilogue -------------------------------------------
@pytest.mark.parametrize("route, passes", [
    ("int16", 2), pytest.param("vnni16", 2, marks=needs("avx512_vnni")), pytest.param("vnni8", 1, marks=needs_vnni),
    pytest.param("amx8", 1, marks=needs_amx), ("int_mm", 1), ("int_mm", 2),
    pytest.param("amx_digits", 2, marks=needs_amx), ("float", 1), ("float", 2)])
@pytest.mark.parametrize("m", [1, 37, 200])
def test_the_residual_add_in_the_epilogue_is_torchs_addition_after_it(route, passes, m):
    """linear(x, ..., residual) -- the decoder's `h + o(attn)` and `h + down(mlp)` with the addition in
    the kernel's epilogue -- gives the bits of adding the residual to the unfused output, on every route,
    and leaves the residual as it was."""
    from prism_backend.model.exact_matmul import ExactWeight

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 577, generator=gen) * torch.linspace(0.1, 9, 577)
    _, w = extreme_integers(3, 577, 97, int_bound(passes), int_bound(passes), seed=m)
    w_scale, b = torch.rand(97, generator=gen) * 1e-3, torch.randn(97, generator=gen)
    residual = torch.randn(m, 97, generator=gen) * 4
    kept = residual.clone()
    weight = ExactWeight(w, passes, passes, route)
    assert weight.route == route
    fused = weight.linear(x, w_scale, b, residual)
    assert torch.equal(fused, residual + weight.linear(x, w_scale, b)) and torch.equal(residual, kept)
    if weight.fused is not None:  # the library refuses a residual of the wrong shape instead of misreading it
        with pytest.raises(ValueError, match="residual"):
            weight.linear(x, w_scale, b, residual[:, :-1].contiguous())
