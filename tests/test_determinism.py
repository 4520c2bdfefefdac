"""INT8 path: bit-identical probabilities however requests are batched, and exact integer GEMMs."""
import math
import numpy as np
import pytest
import torch

from prism_backend.config import ComputeSettings
from prism_backend.model.quant import Int8Linear
from prism_backend.serving.determinism import batchings, engine_self_check, synthetic_requests, thread_count_check
from prism_client.determinism import CHECK_REQUESTS, digest

from helpers import SAMPLE_TICKET
from helpers import skip_unless_route_available


def score_texts(pipeline):
    def score(requests):
        results, _ = pipeline.decide_many(requests)
        return [[np.array(list(d["probabilities"].values()), np.float32) for d in r] for r in results]
    return score


def test_int8_bits_do_not_depend_on_batching(int8_pipeline):
    requests = CHECK_REQUESTS + [{"material": SAMPLE_TICKET, "tasks": ["team", "severity"]}]
    ok, digests = engine_self_check(score_texts(int8_pipeline), requests)
    assert ok, digests
    assert len(set(digests["alone"])) == len(requests)  # different requests, different bits


def test_int8_bits_do_not_depend_on_batch_neighbours(int8_pipeline):
    """One request, packed with 0 to 7 unrelated requests at every position."""
    score = score_texts(int8_pipeline)
    target = {"material": "My card was declined twice today.", "tasks": ["team", "severity"]}
    alone = digest(score([target])[0])
    fillers = [{"material": f"Unrelated ticket number {i} about printers.", "tasks": ["reply_time"]} for i in range(7)]
    for n in (1, 3, 7):
        for position in (0, n // 2, n):
            batch = fillers[:n]
            batch.insert(position, target)
            assert digest(score(batch)[position]) == alone, (n, position)


def test_synthetic_self_check_passes_in_int8(int8_pipeline):
    """The decision step's startup check (token ids, no tokenizer). fp32 is not expected to pass:
    its float GEMM reduces in an order that depends on the number of rows."""
    engine = int8_pipeline.engine

    def score(reqs):
        return [[s.probabilities for s in r] for r in engine.score(reqs)[0]]

    ok, digests = engine_self_check(score, synthetic_requests(engine.spec.vocab_size))
    assert ok, digests


def test_batchings_cover_alone_and_together():
    names = dict(batchings(4))
    assert names["alone"] == [[0], [1], [2], [3]] and names["one batch"] == [[0, 1, 2, 3]]


def test_int_mm_is_exact_and_row_invariant():
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (37, 576), dtype=torch.int8)
    b = torch.randint(-127, 128, (576, 200), dtype=torch.int8)
    full = torch._int_mm(a, b)
    assert torch.equal(full.long(), a.long() @ b.long())
    for rows in (slice(0, 1), slice(5, 22), slice(36, 37)):
        assert torch.equal(torch._int_mm(a[rows].contiguous(), b), full[rows])


PASS_CASES = [(1, 1, 0.02), (2, 1, 0.008), (1, 2, 0.02), (2, 2, 8e-4), (3, 2, 4e-4)]
# every route for every pass count; the 8-bit kernel only where it applies (one pass a side)
# where a forced route cannot take three activation passes: the int16 kernel (either form) leaves it
# to the float route, the AMX digits kernel (two digits) to int_mm
THREE_PASS_FALLBACK = {("int16", 3): "float", ("vnni16", 3): "float", ("amx_digits", 3): "int_mm"}
ROUTE_CASES = [(*case, route) for case in PASS_CASES
               for route in ("int_mm", "int16", "vnni16", "vnni8", "amx8", "amx_digits", "float")
               if route not in ("vnni8", "amx8") or case[:2] == (1, 1)]


@pytest.mark.parametrize("passes, weight_passes, bound, route", ROUTE_CASES)
def test_int8_linear_rows_are_batch_invariant_and_close(passes, weight_passes, bound, route, monkeypatch):
    """With one pass each side the int8 weight's rounding (~0.4% of a row's max) dominates; two
    passes each side (13 bits) leave ~4e-4. Every exact route gives the bits of the float route,
    which runs on every CPU: so every route this CPU has gives the same bits (a route it lacks skips,
    naming the instructions)."""
    from prism_backend.model import exact_matmul

    skip_unless_route_available(route)
    torch.manual_seed(1)
    w, bias = torch.randn(96, 1100), torch.randn(96)  # K = 1100: the fp32 route cuts it in two chunks
    x = torch.randn(33, 1100) * torch.linspace(0.1, 8, 1100)  # outlier channels
    monkeypatch.setattr(exact_matmul, "_route", route)
    lin = Int8Linear(w, bias, ComputeSettings("int8", passes, weight_passes))
    # 3 passes exceed int16 (the float route takes them) and the AMX digits kernel's two digits (int_mm)
    assert lin.w.route == THREE_PASS_FALLBACK.get((route, passes), route)
    full = lin(x)
    for i in (0, 17, 32):
        assert torch.equal(lin(x[i : i + 1]), full[i : i + 1])
    exact = x.double() @ w.double().T + bias.double()
    rel = ((full.double() - exact).abs().max() / (x @ w.T).abs().max()).item()
    assert rel < bound
    monkeypatch.setattr(exact_matmul, "_route", "float")
    reference = Int8Linear(w, bias, ComputeSettings("int8", passes, weight_passes))
    assert reference.w.route == "float" and torch.equal(reference(x), full)


def test_int8_close_to_fp32_on_the_sample_ticket(int8_pipeline, pipeline):
    tasks = ["team", "reply_time", "severity"]
    for q, r in zip(int8_pipeline.decide(SAMPLE_TICKET, tasks), pipeline.decide(SAMPLE_TICKET, tasks)):
        diff = np.abs(np.array(list(q["probabilities"].values())) - np.array(list(r["probabilities"].values())))
        assert diff.max() < 0.05
        assert q["label"] == r["label"]


def test_int8_bits_do_not_depend_on_thread_count(fp32_config):
    """Instances get cpu_count / N threads each: the bits must not depend on it (smoothing is
    calibrated on one thread; the int8 forward is thread-count invariant)."""
    from prism_backend.engine.engine import DecisionEngine

    bits, original = [], torch.get_num_threads()
    for threads in (1, 2):
        engine = DecisionEngine(fp32_config.replace(precision="int8", num_threads=threads))
        results, _ = engine.score(synthetic_requests(engine.spec.vocab_size))
        bits.append([[s.probabilities.tobytes() for s in r] for r in results])
    torch.set_num_threads(original)
    assert bits[0] == bits[1]


def test_thread_count_check_compares_configured_with_one_thread():
    """The startup check's comparison itself (a scorer whose output depends on the thread count
    stands in for a machine where it breaks)."""
    requests = ["a", "b"]
    seen = []

    def invariant(reqs, threads):
        seen.append(threads)
        return [[np.float32([0.25, 0.75])] for _ in reqs]

    def thread_dependent(reqs, threads):
        return [[np.float32([0.25, 0.75]) + np.float32(1e-3) * threads] for _ in reqs]

    assert thread_count_check(invariant, requests, 4)[0] and seen == [4, 1]
    seen.clear()
    assert thread_count_check(invariant, requests, 1)[0] and seen == [1, 2]  # one thread: compare with two
    ok, digests = thread_count_check(thread_dependent, requests, 2)
    assert not ok and set(digests) == {1, 2}


@pytest.mark.parametrize("k", [576, 1040, 1041, 1536, 4100])
@pytest.mark.parametrize("act_passes, weight_passes, route",
                         [(*p, r) for p in [(1, 1), (2, 2), (3, 2)]
                          for r in ("int_mm", "int16", "vnni16", "vnni8", "amx8", "amx_digits", "float")
                          if r not in ("vnni8", "amx8") or p == (1, 1)])
def test_every_cpu_int8_route_is_exact(k, act_passes, weight_passes, route):
    """torch._int_mm on the int8 passes, the int16 and 8-bit kernels and the float GEMMs
    (exact_matmul.py) give the int64 matmul's values, also at the extreme where every product is the
    largest possible: one fp32 chunk's sum reaches 1040 * 127^2 (one pass), one int32 chunk of the
    int16 kernel 32 * 8191^2 (two passes), a float64 sum 4100 * 2080768 * 8191 (three and two passes)."""
    from prism_backend.model.exact_matmul import ExactWeight, int_bound

    skip_unless_route_available(route)
    torch.manual_seed(k)
    xb, wb = int_bound(act_passes), int_bound(weight_passes)
    x = torch.randint(-xb, xb + 1, (37, k)).float()
    w = torch.randint(-wb, wb + 1, (k, 96)).float()
    x[0], w[:, 0] = xb, wb  # row 0 x column 0: the largest possible sum
    x[1], w[:, 1] = -xb, wb
    exact = x.long() @ w.long()
    weight = ExactWeight(w, act_passes, weight_passes, route)
    assert weight.route == THREE_PASS_FALLBACK.get((route, act_passes), route)
    got = weight.matmul(x)
    assert got.dtype == torch.float64 and torch.equal(got.long(), exact)


def test_route_is_the_fastest_exact_route_per_pass_count(monkeypatch):
    """route() times every route that can run here, per pass count, and keeps the fastest; the
    int16 kernel (either form) is never a candidate for integers beyond int16 (three activation
    passes), its VNNI form a candidate exactly where the CPU has AVX-512 VNNI."""
    from kernels.cpu import exact_gemm
    from prism_backend.model import exact_matmul

    monkeypatch.delenv("PRISM_EXACT_ROUTE", raising=False)
    monkeypatch.delenv("PRISM_INT8_ROUTE", raising=False)
    monkeypatch.setattr(exact_matmul, "_route", None)
    monkeypatch.setattr(exact_matmul, "_fastest", {})
    timed = []  # the route of each ExactWeight whose served projection is being timed
    real_linear = exact_matmul.ExactWeight.linear
    monkeypatch.setattr(exact_matmul.ExactWeight, "linear",
                        lambda self, *args: (timed.append(self.route), real_linear(self, *args))[1])

    def costs(seconds):  # a stand-in clock: each route takes `seconds[route]`
        return lambda fn: (fn(), seconds[timed[-1]])[1]

    has_int16, has_vnni8 = exact_gemm.load() is not None, exact_gemm.vnni8_available()
    has_amx8 = exact_gemm.amx8_available()
    monkeypatch.setattr(exact_matmul, "_time", costs({"int_mm": 1.0, "int16": 2.0, "vnni16": 2.25,
                                                      "vnni8": 0.5, "amx8": 0.7, "amx_digits": 1.5, "float": 3.0}))
    assert exact_matmul.route(2, 2) == "int_mm"  # the 8-bit kernel is no candidate for two passes
    assert set(timed) == ({"int_mm", "float"} | ({"int16"} if has_int16 else set())
                          | ({"vnni16"} if has_vnni8 else set()) | ({"amx_digits"} if has_amx8 else set()))
    timed.clear()
    monkeypatch.setattr(exact_matmul, "_time", costs({"int_mm": 3.0, "int16": 1.0, "vnni16": 1.25,
                                                      "vnni8": 0.5, "amx8": 0.7, "amx_digits": 1.5, "float": 2.0}))
    assert exact_matmul.route(2, 2) == "int_mm"  # chosen once per process, pass counts and shape
    assert exact_matmul.route(3, 2) == "float" and not {"int16", "vnni16"} & set(timed)  # 3 passes do not fit int16
    assert exact_matmul.route(1, 1) == ("vnni8" if has_vnni8 else "int16" if has_int16 else "float")
    assert ("vnni8" in timed) == has_vnni8  # a candidate for one pass a side where the CPU runs it
    assert ("amx8" in timed) == has_amx8  # likewise the AMX variant
    exact_matmul._fastest.clear()
    timed.clear()
    monkeypatch.setattr(exact_matmul, "_time", costs({"int_mm": 3.0, "int16": 1.0, "vnni16": 1.25,
                                                      "vnni8": 1.5, "amx8": 0.4, "amx_digits": 0.5, "float": 2.0}))
    # a slower 8-bit kernel is not kept
    assert exact_matmul.route(1, 1) == ("amx8" if has_amx8 else "int16" if has_int16 else "float")
    assert exact_matmul.route(1, 1, (1536, 576)) == exact_matmul.route(1, 1)
    assert len(exact_matmul.chosen_routes()) == 2  # one per pass counts and shape
    one_pass = exact_matmul.route(1, 1)  # what the server's log and the benchmarks print, shapes sorted
    assert exact_matmul.describe_chosen_routes() == f"1+1 576x1536 {one_pass}, 1+1 1536x576 {one_pass}"
    monkeypatch.setenv("PRISM_EXACT_ROUTE", "float")
    monkeypatch.setattr(exact_matmul, "_route", None)
    assert exact_matmul.route(1, 1) == "float"  # forced for every pass count


def test_the_route_variable_and_its_older_name(monkeypatch):
    """PRISM_EXACT_ROUTE forces a route; its older name PRISM_INT8_ROUTE still does; both set must agree."""
    from prism_backend.model import exact_matmul

    for new, old, forced in [("float", "", "float"), ("", "float", "float"), ("int_mm", "int_mm", "int_mm")]:
        monkeypatch.setenv("PRISM_EXACT_ROUTE", new)
        monkeypatch.setenv("PRISM_INT8_ROUTE", old)
        monkeypatch.setattr(exact_matmul, "_route", None)
        assert exact_matmul.route(2, 2) == forced, (new, old)
    monkeypatch.setenv("PRISM_EXACT_ROUTE", "float")
    monkeypatch.setenv("PRISM_INT8_ROUTE", "int_mm")
    monkeypatch.setattr(exact_matmul, "_route", None)
    with pytest.raises(ValueError, match="disagree"):
        exact_matmul.route(2, 2)
    monkeypatch.delenv("PRISM_EXACT_ROUTE")
    monkeypatch.setenv("PRISM_INT8_ROUTE", "int4")
    with pytest.raises(ValueError, match="PRISM_INT8_ROUTE must be one of"):
        exact_matmul.route(2, 2)


def test_route_timing_interleaves_the_routes_and_gives_up_on_one_that_cannot_win(monkeypatch):
    """_fastest_route keeps each route's fastest call (noise only adds time), times the routes in
    interleaved rounds (so a burst longer than a call cannot fall on one route alone), and drops a
    route once one call takes over five times the best so far, or its warm-up over twenty times the
    fastest warm-up."""
    from prism_backend.model import exact_matmul

    clock, log = [0.0], []
    monkeypatch.setattr(exact_matmul.time, "perf_counter", lambda: clock[0])

    def route(name, seconds, burst=lambda call: 0.0):  # each call takes `seconds` + the burst at that moment
        def fn():
            log.append(name)
            clock[0] += seconds + burst(len(log))
        return fn

    # a burst over calls 3-8: timed one after another, "a" (warm-up at call 1, rounds at 2-6) would
    # have taken 3.0 at best and lost to "b"; interleaved, its later rounds run clean
    burst = lambda call: 2.0 if 3 <= call <= 8 else 0.0  # noqa: E731
    calls = {"a": route("a", 1.0, burst), "b": route("b", 1.25, burst)}
    assert exact_matmul._fastest_route(calls) == "a"
    assert log == ["a", "b"] + ["a", "b"] * exact_matmul.ROUNDS  # warm-ups, then one call each per round
    log.clear()
    calls = {"a": route("a", 1.0), "slow": route("slow", 6.0), "c": route("c", 0.75)}
    assert exact_matmul._fastest_route(calls) == "c"
    assert log.count("slow") == 2  # its warm-up, then its first timed call past five times a's 1.0
    log.clear()
    calls = {"a": route("a", 1.0), "cold": route("cold", 25.0)}  # a warm-up past twenty times a's
    assert exact_matmul._fastest_route(calls) == "a" and log.count("cold") == 1
    log.clear()  # a burst on the only route, past five times its best: still the answer
    assert exact_matmul._fastest_route({"only": route("only", 1.0, lambda call: 9.0 if call == 4 else 0.0)}) == "only"
