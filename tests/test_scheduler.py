"""Prism's request queue (prism_backend/serving/scheduler.py) without Triton: urgent first, admission
bounded in time at the door, the backstop, stop, and a failing batch; the engine is a stand-in
whose batches take as long as the test says."""
import threading
import time

import pytest

import numpy as np

from prism_backend.serving.scheduler import (BACKSTOP_GRACE, GATHER_SPAN, Rejection, Scheduler, Ticket, new_rows,
                                             shared_rows)


class SlowEngine:
    """run_batch for a Scheduler: records each batch's items, and holds each batch until the test
    releases it (so a backlog builds deterministically) or, with `seconds`, sleeps that long."""

    def __init__(self, seconds: float | None = None):
        self.seconds, self.batches, self.rejected = seconds, [], []
        self.release, self.started = threading.Semaphore(0), threading.Semaphore(0)

    def run_batch(self, tickets):
        self.batches.append([t.item for t in tickets])
        self.started.release()
        if self.seconds is None:
            assert self.release.acquire(timeout=30)
        else:
            time.sleep(self.seconds)

    def reject(self, item, rejection: Rejection):
        self.rejected.append((item, rejection))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_urgent_requests_overtake_queued_bulk_ones_in_batches():
    engine = SlowEngine()
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=2, bound_s=60).start()
    assert scheduler.submit("bulk-0") is None
    assert engine.started.acquire(timeout=10)  # bulk-0 runs alone; the rest queues behind it
    for item, urgent in (("bulk-1", False), ("bulk-2", False), ("bulk-3", False), ("urgent-0", True),
                         ("urgent-1", True), ("urgent-2", True)):
        assert scheduler.submit(item, urgent) is None
    for _ in range(5):
        engine.release.release()
    wait_until(lambda: len(engine.batches) == 5 and scheduler.queued() == 0)
    # urgent-2 goes alone: bulk rows in its batch would delay it
    assert engine.batches == [["bulk-0"], ["urgent-0", "urgent-1"], ["urgent-2"], ["bulk-1", "bulk-2"], ["bulk-3"]]
    engine.release.release()
    scheduler.stop()
    assert not engine.rejected


def test_the_door_refuses_what_could_not_be_answered_within_the_bound():
    """After one measured batch (0.2 s a request), a bound of 1.43 s (planned within 1 s) admits about
    four queued requests and refuses the next at once, saying why and when to retry; an urgent request
    still gets in (it overtakes the queued bulk ones); an idle scheduler admits whatever comes."""
    engine = SlowEngine(seconds=0.2)
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=1, bound_s=1.43).start()
    assert scheduler.planned_s == pytest.approx(1.0, abs=0.01)
    assert scheduler.submit("warm-up") is None
    wait_until(lambda: scheduler.seconds_per_request > 0 and scheduler.queued() == 0)
    assert scheduler.seconds_per_request == pytest.approx(0.2, abs=0.1)
    engine.seconds = 5.0  # the next batch is slow: what is behind it stays queued
    outcomes = [scheduler.submit(f"bulk-{i}") for i in range(8)]
    admitted = [o for o in outcomes if o is None]
    refused = [o for o in outcomes if o is not None]
    assert 2 <= len(admitted) <= 6 and refused and outcomes.index(refused[0]) == len(admitted)
    assert refused[0].reason == "door" and refused[0].retry_after_s >= 1
    assert "more than the 1.43 s bound allows (prism serve --max-queue-wait-s)" in refused[0].message
    assert f"retry after {refused[0].retry_after_s} s" in refused[0].message
    assert scheduler.submit("urgent", urgent=True) is None
    scheduler.stop(timeout=0)  # the queued ones are refused as "stopping"
    assert {r.reason for _, r in engine.rejected} == {"stopping"}
    assert scheduler.submit("late").reason == "stopping"


def test_the_backstop_refuses_requests_that_waited_past_the_bound():
    """A request admitted while the estimate said it would make it, but whose batch starts too late
    (the batch ahead took far longer than measured), is refused unscored as "overdue"."""
    clock = [0.0]
    engine = SlowEngine()
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=1, bound_s=1.43, clock=lambda: clock[0])
    scheduler.seconds_per_request = 0.1
    scheduler.start()
    assert scheduler.submit("first") is None
    assert engine.started.acquire(timeout=10)
    assert scheduler.submit("late") is None
    clock[0] = 0.9
    assert scheduler.submit("on time") is None
    clock[0] = 0.95  # "late" has waited 0.95 s: with ~0.1-0.4 s to score it, it would end past the planned 1 s
    engine.release.release()
    wait_until(lambda: engine.rejected and len(engine.batches) == 2)
    (item, rejection), = engine.rejected
    assert item == "late" and rejection.reason == "overdue" and "waited 0.9 s" in rejection.message
    assert engine.batches == [["first"], ["on time"]]  # it waited 0.05 s: within the grace, scored
    assert BACKSTOP_GRACE * 1.43 > 0.05
    engine.release.release()
    scheduler.stop()


def test_a_failing_batch_is_answered_and_the_thread_goes_on():
    calls = []

    def run_batch(tickets):
        calls.append([t.item for t in tickets])
        if len(calls) == 1:
            raise RuntimeError("boom")

    rejected = []
    scheduler = Scheduler(run_batch, lambda item, r: rejected.append((item, r)), 4, 10.0).start()
    scheduler.submit("a")
    wait_until(lambda: rejected)
    assert rejected[0][0] == "a" and rejected[0][1].reason == "error" and "boom" in rejected[0][1].message
    scheduler.submit("b")
    wait_until(lambda: len(calls) == 2)
    scheduler.stop()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Scheduler(lambda t: None, lambda i, r: None, max_batch_size=0, bound_s=1)
    with pytest.raises(ValueError):
        Scheduler(lambda t: None, lambda i, r: None, max_batch_size=1, bound_s=0)
    with pytest.raises(ValueError, match="max_batch_rows"):
        Scheduler(lambda t: None, lambda i, r: None, max_batch_size=1, bound_s=1, max_batch_rows=-1)


def test_setup_runs_on_the_thread_that_scores_and_its_error_reaches_start():
    """The engine is built where it runs (one OpenMP team, Scheduler.start): setup() runs on the
    scheduler's thread before it serves, start() hands back its result, and an error in setup is
    raised by start() instead of leaving a thread that serves nothing."""
    threads = []
    scored = threading.Event()

    def run_batch(tickets):
        threads.append(threading.get_ident())
        scored.set()

    scheduler = Scheduler(run_batch, lambda item, r: None, 2, 10.0)
    assert scheduler.start(setup=lambda: threads.append(threading.get_ident()) or "engine").setup_result == "engine"
    assert threads[0] != threading.get_ident()
    assert scheduler.submit("request") is None and scored.wait(5)
    assert threads[1] == threads[0]  # scored on the thread that built
    scheduler.stop()

    def broken():
        raise RuntimeError("no checkpoint")

    with pytest.raises(RuntimeError, match="no checkpoint"):
        Scheduler(run_batch, lambda item, r: None, 2, 10.0).start(setup=broken)


def test_rows_a_request_shares_with_the_batch_count_once():
    assert shared_rows(np.array([1, 2, 3, 4]), np.array([1, 2, 9])) == 2
    assert shared_rows(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert shared_rows(np.array([5]), np.array([1])) == 0
    assert shared_rows((), np.array([1])) == 0
    first = Ticket("a", False, 0.0, rows=110, prefix=np.arange(100))
    same_start = Ticket("b", False, 0.0, rows=120, prefix=np.r_[np.arange(60), np.full(50, 7)])
    other = Ticket("c", False, 0.0, rows=30, prefix=np.full(20, 3))
    assert new_rows(first, []) == 110
    assert new_rows(same_start, [first]) == 60  # its first 60 ids are computed once, with `first`'s
    assert new_rows(other, [first, same_start]) == 30


def test_a_batch_holds_requests_within_the_row_budget_and_a_large_one_alone():
    """With the engine busy, five requests queue; with a 1000-row budget the batches are cut where
    the next request's new rows would pass it, shared starts counted once, and a request larger than
    the budget runs alone rather than never."""
    engine = SlowEngine()
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=8, bound_s=60, max_batch_rows=1000).start()
    assert scheduler.submit("first", rows=10, prefix=np.arange(10)) is None
    assert engine.started.acquire(timeout=10)
    ticket = np.arange(500)
    for item, rows, prefix in (("t-400", 400, np.full(400, 1)), ("t-500", 500, np.full(500, 2)),
                               ("huge", 1500, np.full(1500, 3)),  # 400 + 500 + 1500 > 1000: cut before it
                               ("q1", 520, ticket), ("q2", 520, ticket), ("q3", 530, ticket)):  # 520 + 20 + 30
        assert scheduler.submit(item, rows=rows, prefix=prefix) is None
    for _ in range(4):
        engine.release.release()
    wait_until(lambda: len(engine.batches) == 4 and scheduler.queued() == 0)
    assert engine.batches == [["first"], ["t-400", "t-500"], ["huge"], ["q1", "q2", "q3"]]
    engine.release.release()
    scheduler.stop()


def test_an_idle_engine_gathers_requests_sent_together():
    """Two requests 50 ms apart: with a 2 s gathering window they form one batch; a full batch
    starts without waiting out the window; without a window the first runs alone."""
    for gather_s, size, expected in ((2.0, 8, [["x", "y"]]), (0.0, 8, [["x"], ["y"]]), (30.0, 2, [["x", "y"]])):
        engine = SlowEngine(seconds=0.0)
        scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=size, bound_s=60,
                              gather_s=gather_s).start()
        start = time.monotonic()
        scheduler.submit("x")
        time.sleep(0.05)
        scheduler.submit("y")
        wait_until(lambda: sum(map(len, engine.batches)) == 2)
        assert engine.batches == expected, gather_s
        if gather_s == 30.0:  # full at two requests: scored long before the window's end
            assert time.monotonic() - start < 10
        scheduler.stop()


def test_gathering_waits_for_the_group_it_found_last():
    """A window waited out for nobody: the next lone request starts at once. A request arriving
    within the window of that lone start makes the group two: the next two requests sent together
    form one batch, started as the second arrives, long before the window's end."""
    engine = SlowEngine()
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=8, bound_s=60, gather_s=2.0).start()
    scheduler.submit("a")
    assert engine.started.acquire(timeout=10)  # after its 2 s window, alone
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    start = time.monotonic()
    scheduler.submit("b")
    assert engine.started.acquire(timeout=10)
    assert time.monotonic() - start < 1.0  # no window: nobody came the last time
    scheduler.submit("c")  # within b's would-be window: requests come in groups again
    engine.release.release()
    assert engine.started.acquire(timeout=10)  # c, queued behind b
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    start = time.monotonic()
    scheduler.submit("d")
    time.sleep(0.05)
    scheduler.submit("e")
    assert engine.started.acquire(timeout=10)
    assert time.monotonic() - start < 1.0  # on e's arrival, not at the 2 s window's end
    engine.release.release()
    assert engine.batches == [["a"], ["b"], ["c"], ["d", "e"]]
    scheduler.stop()


def test_a_request_arriving_within_the_window_stretches_it():
    """Three requests 0.6 s apart with a 1 s window: the third arrives after the first's window but
    within the second's, so the three form one batch; without the stretch the third ran alone."""
    engine = SlowEngine(seconds=0.0)
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=8, bound_s=60, gather_s=1.0).start()
    scheduler.submit("x")
    time.sleep(0.6)
    scheduler.submit("y")
    time.sleep(0.6)
    scheduler.submit("z")
    wait_until(lambda: sum(map(len, engine.batches)) == 3)
    assert engine.batches == [["x", "y", "z"]]
    scheduler.stop()


def test_a_stretched_window_ends_at_its_span():
    """Requests every 0.3 s, each within the 0.5 s window of the one before: the window stops
    stretching GATHER_SPAN windows (2 s) after the first request, and the requests after that form
    the next batch."""
    engine = SlowEngine(seconds=0.0)
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=16, bound_s=60, gather_s=0.5).start()
    start = time.monotonic()
    sent = []
    for i in range(10):  # 0, 0.3, ..., 2.7 s
        scheduler.submit(i)
        sent.append(time.monotonic() - start)
        time.sleep(0.3)
    wait_until(lambda: sum(map(len, engine.batches)) == 10)
    first = engine.batches[0]
    assert first == list(range(len(first)))
    assert all(sent[i] <= GATHER_SPAN * 0.5 for i in first)  # no request after the span joined it
    assert len(first) >= 5 and len(engine.batches) >= 2  # ~7 arrived within it (timing slack on a busy CI)
    scheduler.stop()


def test_requests_that_arrive_while_a_lone_started_batch_runs_join_the_next_group():
    """A group sent together whose first request started alone (the last group was one) and whose
    others arrive after the window but while that first batch runs (their tokenizer steps slowed
    by it): the next group of that size waits for its last request and forms one batch. A request
    arriving after that batch ended is not counted: the lone caller after it starts at once."""
    engine = SlowEngine()
    scheduler = Scheduler(engine.run_batch, engine.reject, max_batch_size=8, bound_s=60, gather_s=0.2).start()
    scheduler.submit("lone")
    assert engine.started.acquire(timeout=10)  # waits out the first window: nobody else comes
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    scheduler.submit("x1")  # the group learned is one: x1 starts at once, alone
    assert engine.started.acquire(timeout=10)
    time.sleep(0.3)  # past x1's window, while its batch runs
    scheduler.submit("x2")
    scheduler.submit("x3")
    engine.release.release()
    assert engine.started.acquire(timeout=10)  # x2 and x3, queued behind x1
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    scheduler.submit("y1")
    time.sleep(0.05)
    scheduler.submit("y2")
    time.sleep(0.05)
    scheduler.submit("y3")
    assert engine.started.acquire(timeout=10)
    assert engine.batches[-1] == ["y1", "y2", "y3"]  # without counting x2, x3: y1 alone
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    time.sleep(0.3)  # y's window over and its batch ended: a request now is no one's late member
    scheduler.submit("z")
    assert engine.started.acquire(timeout=10)
    engine.release.release()
    wait_until(lambda: scheduler._running is None)
    start = time.monotonic()
    scheduler.submit("lone again")  # the group learned from z's window: one
    assert engine.started.acquire(timeout=10)
    assert time.monotonic() - start < 0.15
    engine.release.release()
    assert engine.batches == [["lone"], ["x1"], ["x2", "x3"], ["y1", "y2", "y3"], ["z"], ["lone again"]]
    scheduler.stop()


def test_a_request_s_size_is_read_from_its_token_tensors():
    """What prism_decision's execute() queues with each request: its rows and its shareable ids;
    tensors that validation will refuse later count as nothing, never raise here."""
    from prism_backend.serving.steps import request_size

    tensors = {"root_ids": np.array([[1, 2]], np.int32), "trunk_ids": np.array([[3, 4, 5]], np.int32),
               "branch_ids": np.array([[6, 7, 8, 9]], np.int32)}
    rows, prefix = request_size(tensors)
    assert rows == 9 and prefix.tolist() == [1, 2, 3, 4, 5]
    rows, prefix = request_size({"root_ids": None, "trunk_ids": np.array([0.5]), "branch_ids": np.array([[6]])})
    assert rows == 1 and prefix.size == 0
