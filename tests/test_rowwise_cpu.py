"""The decoder's row-wise passes in the kernel library (kernels/cpu/rowwise.py): RMSNorm and SwiGLU (with
down_proj's online Hadamard fused) against float64, the rotary embedding against torch's operations, and bits that depend on nothing but the row: not
the other rows, not the thread count, not the CPU kind (committed digests, recomputed here); RMSNorm and
SwiGLU run in the next projection's quantiser pass (kernels/cpu/prologues.py) giving the integers of the
two passes one after the other, and a projection given them the bits of its input computed first."""
from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import needs, skip_unless_route_available

from kernels.cpu import exact_gemm, rowwise
from kernels.cpu.features import has_avx512
from kernels.cpu.prologues import Hadamard, RmsNorm, SwiGLU
from prism_backend.model import hadamard, layers
from prism_backend.reproducibility import torch_threads

pytestmark = needs("avx2")  # the kernel library is built for x86 CPUs with AVX2 + FMA


def integer_valued(shape, seed: int, scale: float) -> torch.Tensor:
    """Inputs every machine generates to the bit (torch's integer RNG is the same on every CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-512, 513, shape, generator=gen).float() * scale


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("h", [576, 577, 5, 64])
def test_rms_norm_is_the_float64_one_to_float32_rounding(h):
    x, w = integer_valued((37, h), h, 1 / 64), integer_valued((h,), h + 1, 1 / 256)
    got = rowwise.rms_norm(x, w, 1e-5)
    x64 = x.double()
    expected = x64 * (x64.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(layers.rms_norm(x, w, 1e-5), got)  # what the model runs on this CPU


@pytest.mark.parametrize("i, block", [(1536, 128), (1536, 0), (13, 0), (24, 8)])
def test_swiglu_is_the_float64_one_and_fuses_the_hadamard(i, block):
    gate_up = integer_valued((29, 2 * i), i, 1 / 64)
    got = rowwise.swiglu(gate_up, block)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate / (1 + torch.exp(-gate)) * up
    if block:
        assert torch.equal(got, hadamard.transform(rowwise.swiglu(gate_up), block))  # the same pass's bits
        expected = hadamard.transform(expected, block)
    # float32 sums of 128 terms of both signs: within a few ulp of the row's largest value
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    assert torch.equal(layers.swiglu(gate_up, block), got)


@needs("avx512_vnni")  # AVX-512 (VNNI CPUs have the F/DQ/BW/VL the wide SiLU uses)
@pytest.mark.parametrize("i", [1536, 13, 24, 40])
def test_swiglu_16_lanes_give_the_8_lane_bits(i):
    """Where the CPU has AVX-512 the SiLU runs 16 lanes at a time (then 8, then the zero-padded tail):
    every lane the same steps, so the same bits as the AVX2 width (what an AVX2-only machine runs),
    over the whole range of the exp's inputs, clamped ends included."""
    gen = torch.Generator().manual_seed(i)
    gate_up = torch.randn(33, 2 * i, generator=gen) * 30
    gate_up[0, :8] = torch.tensor([-1e4, -88.0, -87.3, -0.0, 0.0, 87.9, 88.5, 1e4])[: min(8, i)]
    assert torch.equal(rowwise.swiglu(gate_up, 0, wide=True), rowwise.swiglu(gate_up, 0, wide=False))


def torch_rotary(x, cos, sin):
    """layers.apply_rotary's torch operations (what the kernel must reproduce to the bit)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    first = x[..., :half] * c[..., :half] - x[..., half:] * s[..., :half]
    second = x[..., half:] * c[..., half:] + x[..., :half] * s[..., half:]
    return torch.cat([first, second], dim=-1)


@pytest.mark.parametrize("heads, d", [(9, 64), (3, 64), (2, 20), (1, 6)])
def test_rotary_is_torchs_operations_to_the_bit(heads, d):
    """Every head of every row with its own angles, vector body and scalar tail (d / 2 = 3, 10)."""
    torch.manual_seed(heads * d)
    x = torch.randn(37, heads, d)
    table = layers.RotaryTable(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 1.0, 4096)
    cos, sin = table(torch.randint(0, 4096, (37,)))
    out = rowwise.rotary(x, cos[:, 0], sin[:, 0])
    assert torch.equal(out, torch_rotary(x, cos[:, 0], sin[:, 0]))
    with torch_threads(1):
        assert torch.equal(layers.apply_rotary(x, cos, sin), out)  # the model's entry point takes it
    assert torch.equal(rowwise.rotary(x[5:6], cos[5:6, 0], sin[5:6, 0]), out[5:6])
    # read in place from a view whose rows lie apart: the queries or keys inside qkv's output
    qkv = torch.cat([torch.randn(37, 7), x.reshape(37, -1), torch.randn(37, 11)], dim=1)
    view = qkv[:, 7 : 7 + heads * d].view(37, heads, d)
    assert not view.is_contiguous() and torch.equal(rowwise.rotary(view, cos[:, 0], sin[:, 0]), out)


def test_a_rows_bits_depend_on_nothing_else():
    x, w = integer_valued((301, 576), 1, 1 / 64), integer_valued((576,), 2, 1 / 256)
    gate_up = integer_valued((301, 3072), 3, 1 / 64)
    with torch_threads(1):
        norm, mlp = rowwise.rms_norm(x, w, 1e-5), rowwise.swiglu(gate_up, 128)
    for threads in (2, 3, 4):
        with torch_threads(threads):
            assert torch.equal(rowwise.rms_norm(x, w, 1e-5), norm)
            assert torch.equal(rowwise.swiglu(gate_up, 128), mlp)
    for rows in (slice(0, 1), slice(17, 40), slice(300, 301)):
        assert torch.equal(rowwise.rms_norm(x[rows], w, 1e-5), norm[rows])
        assert torch.equal(rowwise.swiglu(gate_up[rows], 128), mlp[rows])


# sha256 of the outputs of test_the_same_bits_on_every_cpu_kind's inputs, computed on an Intel Xeon
# (AVX-512 VNNI + BF16 + AMX) on 2026-12-02; every x86-64 CPU with AVX2 + FMA must reproduce them.
GOLDEN_RMS_NORM = "2fa5264b14e564e9307a61ab392e6774102020582e74ab569e3ae9e2519f5243"
GOLDEN_SWIGLU = "d3b532fde130abe00f0d55b37b01a81fb1a3fb01c4d2aea23f353ddae3e0fce8"


def test_the_same_bits_on_every_cpu_kind():
    """AVX2 + FMA instructions only, each IEEE-defined, one order, the library's own exp: the same
    bits on every x86 CPU kind. Committed digests of fixed inputs' outputs, recomputed here."""
    x, w = integer_valued((33, 577), 7, 1 / 64), integer_valued((577,), 8, 1 / 256)
    gate_up = integer_valued((33, 3072), 9, 1 / 32)
    assert digest(rowwise.rms_norm(x, w, 1e-5)) == GOLDEN_RMS_NORM
    assert digest(rowwise.swiglu(gate_up, 128)) == GOLDEN_SWIGLU


# ---- RMSNorm and SwiGLU in the next projection's quantiser pass (kernels/cpu/prologues.py) ----

def quantized(x, k, bound, dtype, prologue=None, wide=None):
    """exact_gemm's row quantiser on x (or on that row pass over x, in the same pass): (operand, scales).
    dtype int8: the integers as base-128 digits (exact_gemm.quantize_digits, the digit kernels' operand):
    two digits for 13-bit bounds, into a buffer with spare rows (left as they were) and padding columns
    (zeroed)."""
    if dtype == torch.int8:
        passes, m = (2 if bound > 127 else 1), x.shape[0]
        q = torch.full((passes, m + 3, k + 5), 99, dtype=torch.int8)
        scale = exact_gemm.quantize_digits(x, k, bound, passes, q, wide=wide, prologue=prologue)
        assert (q[:, m:] == 99).all() and not q[:, :m, k:].any()
        return q[:, :m], scale
    width = -(-k // 4) * 4 if dtype == torch.uint8 else -(-k // 2) * 2
    return exact_gemm._quantize_rows(x, k, bound, width, dtype, wide=wide, prologue=prologue)


def assert_every_thread_count_and_width_gives(expected, x, k, bound, dtype, prologue):
    """The quantiser given `prologue` over x gives `expected` (operand, scales) at 1-4 threads, in both
    vector widths where the CPU has AVX-512."""
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            for wide in (False, True) if has_avx512() else (False,):
                got = quantized(x, k, bound, dtype, prologue, wide)
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (threads, wide)


@pytest.mark.parametrize("dtype, bound", [(torch.int16, 8191), (torch.uint8, 127), (torch.int8, 8191)])
@pytest.mark.parametrize("h", [576, 577, 5, 960])
def test_rms_norm_in_the_quantisers_pass_gives_the_two_passes_integers(h, dtype, bound):
    """RMSNorm computed into a buffer of the thread's and quantised from there: the integers and scales
    of rms_norm's float32 output quantised afterwards, at every thread count and vector width."""
    x, w = integer_valued((41, h), h + 2, 1 / 64), integer_valued((h,), h + 3, 1 / 256)
    x[3] = 0.0  # an all-zero row: scale 1, integers 0
    expected = quantized(rowwise.rms_norm(x, w, 1e-5), h, bound, dtype)
    assert_every_thread_count_and_width_gives(expected, x, h, bound, dtype, RmsNorm(w, 1e-5))


@pytest.mark.parametrize("dtype, bound", [(torch.int16, 8191), (torch.uint8, 127), (torch.int8, 8191)])
@pytest.mark.parametrize("i, block", [(1536, 128), (1536, 0), (13, 0), (24, 8)])
def test_swiglu_in_the_quantisers_pass_gives_the_two_passes_integers(i, block, dtype, bound):
    """SwiGLU (+ down_proj's online Hadamard) likewise: the integers of swiglu's output, quantised after."""
    gate_up = integer_valued((37, 2 * i), i + 4, 1 / 64)
    expected = quantized(rowwise.swiglu(gate_up, block), i, bound, dtype)
    assert_every_thread_count_and_width_gives(expected, gate_up, i, bound, dtype, SwiGLU(block))


@pytest.mark.parametrize("dtype, bound", [(torch.int16, 8191), (torch.uint8, 127), (torch.int8, 8191)])
@pytest.mark.parametrize("k, block", [(1536, 128), (24, 8), (40, 2)])
def test_the_hadamard_in_the_quantisers_pass_gives_the_two_passes_integers(k, block, dtype, bound):
    """down_proj's online Hadamard alone (where gate_up's kernel ended in SwiGLU) likewise."""
    x = integer_valued((37, k), k + 5, 1 / 64)
    expected = quantized(rowwise.hadamard_rows(x, block), k, bound, dtype)
    assert_every_thread_count_and_width_gives(expected, x, k, bound, dtype, Hadamard(block))


def test_the_digits_quantiser_refuses_a_digit_count_it_has_no_room_for():
    """quantize.h keeps each digit's weight in a register array of MAX_DIGITS: more is a clear error."""
    x = integer_valued((3, 16), 1, 1 / 64)
    for passes in (0, exact_gemm.MAX_DIGITS + 1):
        with pytest.raises(ValueError, match="base-128 digits"):
            exact_gemm.quantize_digits(x, 16, 127, passes, torch.zeros(max(passes, 1), 3, 16, dtype=torch.int8))


def test_a_prologue_of_the_wrong_shape_is_refused():
    x = torch.ones(3, 10)
    with pytest.raises(ValueError, match="RMSNorm"):
        quantized(x, 10, 127, torch.int16, RmsNorm(torch.ones(9), 1e-5))
    with pytest.raises(ValueError, match="SwiGLU"):
        quantized(x, 10, 127, torch.int16, SwiGLU(0))  # gate_up must be 2 * 10 wide
    with pytest.raises(ValueError, match="Hadamard"):
        quantized(torch.ones(3, 20), 10, 127, torch.int16, SwiGLU(4))  # 4 does not divide 10
    with pytest.raises(ValueError, match="Hadamard"):
        quantized(x, 10, 127, torch.int16, Hadamard(0))  # the Hadamard alone needs a block


@pytest.mark.parametrize("route, passes", [("int16", 2), ("vnni16", 2), ("vnni8", 1), ("amx8", 1), ("int_mm", 2),
                                            ("amx_digits", 2), ("amx_digits", 1), ("float", 2)])
def test_a_projection_given_a_prologue_gives_the_bits_of_its_input_computed_first(route, passes):
    """What the decoder runs (transformer.py gives qkv and gate_up their RMSNorm, down its SwiGLU): the
    projection's output bits equal those of the row pass run first, for every exact route -- fused
    into the quantiser (int16, vnni16, vnni8, amx8; the digits' quantiser of int_mm and amx_digits), or
    as torch's own pass (float) -- and a Paley-block Hadamard (torch's) still runs, before the kernel."""
    from prism_backend.model.exact_matmul import ExactWeight, int_bound

    skip_unless_route_available(route)
    gen = torch.Generator().manual_seed(passes)
    bound = int_bound(passes)
    h, i, m = 64, 96, 23
    x, w = integer_valued((m, h), 11, 1 / 64), integer_valued((h,), 12, 1 / 256)
    gate_up = integer_valued((m, 2 * i), 13, 1 / 64)
    activated = integer_valued((m, i), 14, 1 / 64)
    for k, rows, prologue in ((h, x, RmsNorm(w, 1e-6)), (i, gate_up, SwiGLU(32)), (i, gate_up, SwiGLU(12)),
                              (i, activated, Hadamard(32)), (i, activated, Hadamard(12))):
        weight = ExactWeight(torch.randint(-bound, bound + 1, (k, 40), generator=gen).float(), passes, passes, route)
        w_scale, bias, residual = torch.rand(40, generator=gen), torch.randn(40, generator=gen), torch.randn(m, 40)
        expected = weight.linear(layers.apply_prologue(prologue, rows), w_scale, bias, residual)
        assert torch.equal(weight.linear(rows, w_scale, bias, residual, prologue), expected), (route, prologue)


@pytest.mark.parametrize("glu_columns", [96, 40])
def test_gate_up_ending_in_swiglu_gives_the_bits_of_swiglu_after_it(glu_columns):
    """The decoder's MLP input as the int8 default builds it: gate_up (GPTQ-style 8-bit integers, a bias
    correction) given its RMSNorm, ending in SwiGLU where its kernel can (the 8-bit tile, VNNI or AMX, and
    whole panels: 96 columns of gate and of up; not 40), equals SwiGLU run on its plain output; down given the
    Hadamard alone then equals down given SwiGLU with it."""
    from prism_backend.config import ComputeSettings
    from prism_backend.model.quant import make_linear

    gen = torch.Generator().manual_seed(glu_columns)
    h, m, i = 64, 29, glu_columns
    x, norm = integer_valued((m, h), 21, 1 / 64), RmsNorm(integer_valued((h,), 22, 1 / 256), 1e-6)
    gate_up_int = (torch.randint(-127, 128, (2 * i, h), generator=gen).float(), torch.rand(2 * i, generator=gen) * 1e-2,
                   torch.randn(2 * i, generator=gen) * 1e-3)
    settings = ComputeSettings(precision="int8")
    fused, plain = (make_linear(None, None, settings, gate_up_int, glu=glu) for glu in (True, False))
    assert fused.fuses_swiglu == (exact_gemm.vnni8_available() and fused.w.route in ("vnni8", "amx8") and i % 16 == 0)
    expected = layers.swiglu(plain(x, prologue=norm))
    if fused.fuses_swiglu:
        assert torch.equal(fused(x, prologue=norm, swiglu=True), expected)
    assert torch.equal(fused(x, prologue=norm), plain(x, prologue=norm))  # the plain product: W's column order
    down = make_linear(torch.randn(h, i, generator=gen), None, settings)
    residual = torch.randn(m, h, generator=gen)
    assert torch.equal(down(expected, residual, prologue=Hadamard(8)),
                       down(plain(x, prologue=norm), residual, prologue=SwiGLU(8)))
