"""Prism's CPU tree attention (kernels/cpu/tree_attention.py), in float32 and in its integer form: the
float64 reference's values, the forest's semantics, and bits that depend on nothing but the segment's
own rows and keys -- not the thread count, not the rest of the batch, not the CPU kind (committed
digests, recomputed here)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import needs

from kernels.cpu import tree_attention as cpu_attention
from kernels.cpu.features import has_avx512
from prism_backend.engine.forest_builder import build_forest
from prism_backend.forest import EncodedRequest
from prism_backend.model.attention import ForestAttention
from prism_backend.reproducibility import torch_threads

pytestmark = needs("avx2")  # the kernel library is built for x86 CPUs with AVX2 + FMA


def integer_valued(shape, seed: int, scale: float) -> torch.Tensor:
    """Inputs every machine generates to the bit: small integers (torch's integer RNG is the same
    on every CPU, its normal sampler's vectorised code is not) times a power of two."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, shape, generator=gen).float() * scale


def forest_qkv(hq: int = 9, hkv: int = 3, seed: int = 0):
    """A forest of two trees (shared trunk blocks, three and one branches, one branch below another
    request's trunk) and its q, k, v: (rows, heads, 64)."""
    a = EncodedRequest((1, 2, 3), tuple(range(10, 300)), ((5, 6), (7,), (8, 9, 4)), ((0, 1),) * 3)
    b = EncodedRequest((1, 2, 3), (50, 51, 52), ((5,),), ((0, 1),))
    c = EncodedRequest((9,), tuple(range(60, 200)), ((5, 6, 7),), ((0, 1),))
    forest = build_forest([a, b, c], block_tokens=64)
    n = len(forest.token_ids)
    q = integer_valued((n, hq, 64), seed, 1 / 32)
    k, v = integer_valued((n, hkv, 64), seed + 1, 1 / 32), integer_valued((n, hkv, 64), seed + 2, 1 / 64)
    return forest, q, k, v


def reference(forest, q, k, v) -> torch.Tensor:
    """softmax(q kᵀ / 8 over each row's visible keys) v, in float64, row by row."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in forest.segments:
        for r in range(s.length):
            visible = s.key_rows[: s.prefix_length + r + 1]
            scores = torch.einsum("hd,jhd->hj", q[s.start + r].double(), keys[visible]) / 8.0
            out[s.start + r] = torch.einsum("hj,jhd->hd", scores.softmax(-1), values[visible])
    return out


def cpu_attention_of(forest, integer: bool = False):
    segments = forest.segments
    return ForestAttention(segments, list(range(len(segments))), [i for i, s in enumerate(segments) if s.is_branch],
                           "auto", torch.device("cpu"), 64, integer)


FORMS = [pytest.param(False, id="float"), pytest.param(True, id="integer")]


@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 4)])
def test_the_kernel_computes_tree_attention(hq, hkv):
    forest, q, k, v = forest_qkv(hq, hkv)
    attention = cpu_attention_of(forest)
    assert attention.cpu_tables is not None  # auto on CPU with heads of 64: Prism's kernel
    rows = attention.rows(q, k, v)
    torch.testing.assert_close(rows.double(), reference(forest, q, k, v), atol=2e-6, rtol=0)
    torch_path = ForestAttention(forest.segments, list(range(len(forest.segments))), [], "torch", q.device, 64)
    torch.testing.assert_close(rows, torch_path.rows(q, k, v), atol=2e-6, rtol=0)


@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 4)])
def test_the_integer_form_is_within_its_quantisation_of_the_reference(hq, hkv):
    """14-bit q and k, 12-bit v and 15-bit weights per row and head: every output within 1e-3 of
    float64's (values up to 1; measured worst 3.0e-4, mean 3.1e-5), the mean within 1e-4. Rows of the
    forest see up to ~300 keys, so the values' int32 sums are flushed (every 64 keys) several times."""
    forest, q, k, v = forest_qkv(hq, hkv)
    expected = reference(forest, q, k, v)
    error = (cpu_attention_of(forest, integer=True).rows(q, k, v).double() - expected).abs()
    assert error.max() <= 1e-3 and error.mean() <= 1e-4, (error.max(), error.mean())
    assert max(s.key_rows.numel() for s in forest.segments) > 256


def test_the_integer_form_keeps_a_large_score_range():
    """Scores spread over [-80, 0] (one key far above the rest): the weights of the small scores
    round to 0 against the largest, which the result then follows to within the quantisation."""
    n = 300
    q = torch.zeros(n, 1, 64)
    q[:, 0, 0] = 8.0
    k = torch.zeros(n, 1, 64)
    k[:, 0, 0] = torch.linspace(-80, 0, n)
    v = torch.randn(n, 1, 64, generator=torch.Generator().manual_seed(3))
    table = cpu_attention.segment_table([(0, n, torch.arange(n), 0)])
    got = cpu_attention.tree_attention(q, k, v, *table, integer=True).double()
    scores = torch.tril(q[:, 0, :].double() @ k[:, 0, :].double().T / 8 + 0.0) \
        .masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    expected = scores.softmax(-1) @ v[:, 0, :].double()
    assert (got[:, 0, :] - expected).abs().max() <= 1e-3 * v.abs().max()


@pytest.mark.parametrize("integer", FORMS)
def test_answer_rows_are_the_same_rows_of_every_row(integer):
    """An answer row computed alone gives the bits it gets among all rows (rows are grouped by 8, 4,
    2 and 1 inside a segment; the grouping changes no bit)."""
    forest, q, k, v = forest_qkv()
    attention = cpu_attention_of(forest, integer)
    rows = attention.rows(q, k, v)
    assert torch.equal(attention.answers(q[forest.answer_rows], k, v), rows[forest.answer_rows])


@pytest.mark.parametrize("integer", FORMS)
def test_a_segments_bits_depend_on_nothing_else(integer):
    """The same segment alone, or with other requests packed around it, under 1-4 threads: the
    same bits."""
    forest, q, k, v = forest_qkv()
    with torch_threads(1):
        full = cpu_attention_of(forest, integer).rows(q, k, v)
    for threads in (2, 3, 4):
        with torch_threads(threads):
            assert torch.equal(cpu_attention_of(forest, integer).rows(q, k, v), full), threads
    alone = EncodedRequest((9,), tuple(range(60, 200)), ((5, 6, 7),), ((0, 1),))
    single = build_forest([alone], block_tokens=64)
    n = len(single.token_ids)
    first = next(i for i, s in enumerate(forest.segments) if s.start >= 0 and forest.token_ids[s.start] == 9)
    start = forest.segments[first].start
    rows = slice(start, start + n)
    got = cpu_attention_of(single, integer).rows(q[rows], k[rows], v[rows])
    assert torch.equal(got, full[rows])


# sha256 of the output bits of test_the_same_bits_on_every_cpu_kind's input: float32 computed on an
# Intel Xeon (AVX-512 VNNI + BF16 + AMX) on 2026-12-02, the integer form on an AMD EPYC (AVX-512 VNNI
# + BF16) on 2026-12-03; every x86-64 CPU with AVX2 + FMA must reproduce them.
GOLDEN = {False: "2287d2bd8decb980ba3eab155dff10db9a190fd89e14632d801ba099b669bbd5",
          True: "e272209880da7bcae51983a69f256d722133de636b121a0cb47a76fadc462045"}


@pytest.mark.parametrize("integer", FORMS)
def test_the_same_bits_on_every_cpu_kind(integer):
    """Every float step is an IEEE-defined operation per lane, in one order, with an exp of its own,
    the one float sum across lanes has a fixed order, and the integer form's dot products are exact
    integer sums: so an AVX2-only EPYC (the AVX2 instance) and an AVX-512 Xeon (the AVX-512 instance)
    compute the same bits. A committed digest of a fixed input's output is recomputed on whatever
    machine runs this."""
    forest, q, k, v = forest_qkv(seed=7)
    out = cpu_attention_of(forest, integer).rows(q, k, v)
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest() == GOLDEN[integer]


@pytest.mark.parametrize("wide", [pytest.param(False, id="avx2"), pytest.param(True, id="avx512", marks=needs("avx512_vnni"))])
@pytest.mark.parametrize("integer", FORMS)
def test_queries_read_in_place_from_a_wider_row_give_the_same_bits(integer, wide):
    """q as the queries inside a qkv projection's output (rows 960 floats apart: where the VNNI tiles'
    rotary epilogue leaves them, read in place, not copied) gives the bits of the same q contiguous,
    on every row and on answer rows alone; the output is contiguous either way."""
    forest, q, k, v = forest_qkv(seed=13)
    n = q.shape[0]
    qkv = torch.full((n, 960), float("nan"))  # the columns beyond q's must never be read
    qkv[:, :576] = q.reshape(n, 576)
    view = qkv[:, :576].reshape(n, 9, 64)
    assert not view.is_contiguous() and view.stride(0) == 960
    (key_rows, table), (answer_keys, answers) = cpu_attention_of(forest).cpu_tables
    out = cpu_attention.tree_attention(view, k, v, key_rows, table, wide=wide, integer=integer)
    assert out.is_contiguous()
    assert torch.equal(out, cpu_attention.tree_attention(q, k, v, key_rows, table, wide=wide, integer=integer))
    rows = torch.as_tensor(forest.answer_rows)
    answer_view = qkv[rows][:, :576].reshape(-1, 9, 64)
    assert not answer_view.is_contiguous()
    assert torch.equal(cpu_attention.tree_attention(answer_view, k, v, answer_keys, answers, wide=wide, integer=integer),
                       cpu_attention.tree_attention(q[rows], k, v, answer_keys, answers, wide=wide, integer=integer))


@pytest.mark.parametrize("wide", [pytest.param(False, id="avx2"), pytest.param(True, id="avx512", marks=needs("avx512_vnni"))])
@pytest.mark.parametrize("integer", FORMS)
def test_keys_and_values_read_in_place_from_a_wider_row_give_the_same_bits(integer, wide):
    """k and v side by side in one buffer (exact_gemm's split output of a qkv projection: the keys'
    and values' columns of each row; here with NaN columns after them, which must never be read) give
    the bits of the same k and v contiguous, on every row and on answer rows alone."""
    forest, q, k, v = forest_qkv(seed=17)
    keys, heads = k.shape[0], k.shape[1]
    width = heads * 64
    kv = torch.full((keys, 2 * width + 64), float("nan"))
    kv[:, :width], kv[:, width : 2 * width] = k.reshape(keys, width), v.reshape(keys, width)
    k_view, v_view = (kv[:, i * width : (i + 1) * width].reshape(keys, heads, 64) for i in (0, 1))
    assert not k_view.is_contiguous() and k_view.stride(0) == 2 * width + 64 and torch.equal(v_view, v)
    (key_rows, table), (answer_keys, answers) = cpu_attention_of(forest).cpu_tables
    answer_q = q[torch.as_tensor(forest.answer_rows)]
    for queries, key_rows, table in ((q, key_rows, table), (answer_q, answer_keys, answers)):  # every row, answers
        expected = cpu_attention.tree_attention(queries, k, v, key_rows, table, wide=wide, integer=integer)
        got = cpu_attention.tree_attention(queries, k_view, v_view, key_rows, table, wide=wide, integer=integer)
        assert not expected.isnan().any() and torch.equal(got, expected)


@needs("avx512_vnni")
@pytest.mark.parametrize("integer", FORMS)
def test_the_avx2_instance_gives_the_avx512_instances_bits(integer):
    """On an AVX-512 CPU both instances run: the AVX2 one (what an AVX2-only CPU runs) gives the bits
    of the AVX-512 one, on every row of a forest and on answer rows alone."""
    forest, q, k, v = forest_qkv(seed=11)
    (key_rows, table), (answer_keys, answers) = cpu_attention_of(forest).cpu_tables
    assert has_avx512()
    wide = cpu_attention.tree_attention(q, k, v, key_rows, table, wide=True, integer=integer)
    assert torch.equal(cpu_attention.tree_attention(q, k, v, key_rows, table, wide=False, integer=integer), wide)
    qa = q[forest.answer_rows]
    assert torch.equal(cpu_attention.tree_attention(qa, k, v, answer_keys, answers, wide=False, integer=integer),
                       cpu_attention.tree_attention(qa, k, v, answer_keys, answers, wide=True, integer=integer))


def test_exp_is_accurate_to_a_few_ulp():
    """prism_exp through the kernel: one key against itself and zeros gives weights exp(s - m)."""
    scores = torch.linspace(-80, 0, 4001, dtype=torch.float32)
    q = torch.zeros(1, 1, 64)
    q[0, 0, 0] = 8.0  # score_j = k_j[0] (q is scaled by 1/8)
    k = torch.zeros(scores.numel(), 1, 64)
    k[:, 0, 0] = scores
    v = torch.zeros(scores.numel(), 1, 64)
    for j in range(0, scores.numel(), 400):  # one value row at a time picks out weight j / sum
        v.zero_()
        v[j, 0, 0] = 1.0
        table = cpu_attention.segment_table([(0, 1, torch.arange(scores.numel()), scores.numel() - 1)])
        got = cpu_attention.tree_attention(q, k, v, *table)[0, 0, 0].double()
        weights = torch.exp(scores.double() - scores.max().double())
        expected = weights[j] / weights.sum()
        assert abs(got - expected) <= 4e-7 * expected + 1e-30, (j, got, expected)
