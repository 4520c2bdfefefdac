"""Prism's own request queue in front of the engine: urgent requests first, every admitted request
answered within a bound, and no idle wait.

Why not Triton's dynamic batcher: Triton 2.51 bounds that queue only through priority levels or a
queue policy, and either one turns the batcher's prefetch off, so a request that arrives while an
execute runs may wait for the batcher's 500 ms idle timer after it (docs/security.md, "Overload");
and its bound is a count (16 queued requests were a 40 s wait on a slow machine), not a time.
So prism_decision's execute() hands its requests to this scheduler and returns at once (Triton's
Python backend lets a model answer later through each request's response sender): Triton's batcher
never waits for the instance and never holds a queue, and the queue lives here, seen whole:

  admission  a request is queued only if the work ahead of it (the rest of the running batch, the
             queued requests it does not overtake) at the measured seconds per request leaves time
             to answer it within `bound_s` (planned within PLANNED_SHARE of it); otherwise it is
             refused at once (Rejection "door") with a hint of when to retry. An idle engine admits
             whatever comes.
  order      urgent requests before every queued bulk one, first come first served within a lane,
             and never in one batch with bulk ones (an urgent request should not wait for bulk
             rows); up to `max_batch_size` requests form one batch (one forest), and no more rows than
             `max_batch_rows` (rows a request shares with an earlier one of the batch -- the
             system prompt, a common start of the material -- counted once, as the forest computes
             them; a request alone is never held back): a batch's time follows its rows, and an
             urgent request waits at most for the batch in flight, so the row budget is what bounds
             that wait, whether the batch holds three short tickets or one long thread.
  gathering  an idle engine does not start on the first request at once: it waits up to
             `gather_s` from that request's arrival for others sent with it (requests a client sends
             together reach this step a few ms apart, each after its own tokenizer step), unless
             the batch is full first. Each request that arrives within the window stretches it to
             `gather_s` after its own arrival, up to GATHER_SPAN windows after the first: the
             tokenizer steps run one after another, so the last of three long materials can reach
             this step more than `gather_s` after the first while each came within it of the one
             before. A request that queued while a batch ran has waited already:
             no gathering then; nor for an urgent request (its batch counts as full at once).
             The window ends early once as many requests are there as came within the last one
             (counting those that arrived after its batch had started, within the window or while
             that batch still ran: the requests sent with a lone-started first one reach this step
             late, their tokenizer steps slowed by its batch on the same cores -- 8-14 ms apart
             measured on (b) against 1-5 ms otherwise): a lone caller, one request
             after another, waits for nobody (it would otherwise wait out every window: 8 ms of a
             ~250 ms answer), a client that sends three at a time starts on its third. A group
             larger than the last one is scored in two batches once and then waited for; a smaller
             one waits out one window.
  backstop   a request whose wait plus its batch's expected time would pass the bound when the
             batch is formed is refused instead of scored (Rejection "overdue"): estimates at the
             door can be off (the first requests, a change of workload).

No Triton here: items are opaque, `run_batch(tickets)` scores and answers a batch, `reject(item,
rejection)` answers one refused item; tests drive it with plain objects and a stand-in clock.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

EWMA_WEIGHT = 0.3  # weight of the newest batch in the seconds-per-request average
# A gathering window stretched by requests arriving within it ends at most this many gather_s after
# its first request. Before the stretch, with gather_s = 8 ms, three ~400-word materials sent
# together through tritonserver (bench/side_by_side.py's (c) sweep at 25% shared) went in two batches
# in 6 of 7 rounds -- the last one reached the decision step more than 8 ms after the first, their
# tokenizer steps one after another -- and in one batch every round with gather_s = 20 ms (Intel
# Xeon, Ice Lake, 2026-12-06). A trickle of requests each within gather_s of the last cannot hold the
# first longer than this.
GATHER_SPAN = 4
# The scheduler plans answers within this share of the bound: the rest is for the steps around its
# queue (tokenizer, postprocess, the front, the network) and for batches that run longer than the
# average under contention. Measured with a 10 s bound, 64 callers retrying at once for 60 s (bench/
# latency_bench.py, AVX-512 machine): planning at 1.0, admitted p99s of 10.1-11.1 s; at 0.8, 8.1 s
# (one replica), 8.9 s (two instances) and 10.6 s (two replicas, whose fronts and tokenizers take a
# larger share of the 2 cores).
PLANNED_SHARE = 0.7
# The backstop never refuses a request that waited less than this share of the bound: where one
# batch alone takes longer than the bound, nothing could be answered in time otherwise.
BACKSTOP_GRACE = 0.1
REASONS = ("door", "overdue", "stopping", "error")


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused, and when a retry may be admitted."""

    reason: str  # one of REASONS
    message: str
    retry_after_s: int
    urgent: bool  # the lane of the refused request


@dataclass
class Ticket:
    item: Any  # what the adapter queued (a Triton request)
    urgent: bool
    arrived: float  # clock() at submit
    rows: int = 1  # the request's prompt rows (system prompt, material, questions)
    prefix: Sequence[int] = ()  # its system prompt and material ids: what another request may share
    waited: float = field(default=0.0)  # seconds from submit to the start of its batch


def shared_rows(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common start of two id sequences (numpy arrays or lists)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def new_rows(ticket: Ticket, batch: list[Ticket]) -> int:
    """Rows `ticket` adds to a forest of `batch`: its own, less the longest start of its system prompt
    and material that a request of the batch has too (the forest computes those once)."""
    return ticket.rows - max((shared_rows(ticket.prefix, other.prefix) for other in batch), default=0)


def retry_hint(seconds: float) -> int:
    """Whole seconds, at least 1: what the message (and HTTP Retry-After) tells the caller."""
    return max(1, math.ceil(seconds))


class Scheduler:
    def __init__(self, run_batch: Callable[[list[Ticket]], None], reject: Callable[[Any, Rejection], None],
                 max_batch_size: int, bound_s: float, clock: Callable[[], float] = time.monotonic,
                 max_batch_rows: int = 0, gather_s: float = 0.0):
        """max_batch_rows: 0 = no row budget. gather_s: 0 = an idle engine starts at once. Waits for
        gathering use the real time (Condition.wait), whatever `clock` is."""
        if max_batch_size < 1 or not bound_s > 0 or max_batch_rows < 0 or gather_s < 0:
            raise ValueError(f"max_batch_size must be >= 1, bound_s > 0, max_batch_rows and gather_s >= 0, "
                             f"got {max_batch_size}, {bound_s}, {max_batch_rows}, {gather_s}")
        self.run_batch, self.reject = run_batch, reject
        self.max_batch_size, self.bound_s, self.clock = max_batch_size, bound_s, clock
        self.max_batch_rows, self.gather_s = max_batch_rows, gather_s
        self.planned_s = PLANNED_SHARE * bound_s  # what admission and the backstop plan for
        self.seconds_per_request = 0.0  # measured: moving average of batch seconds / batch size
        self._lanes = {True: deque(), False: deque()}  # urgent, bulk: Tickets in arrival order
        self._running: tuple[float, int] | None = None  # (start, requests) of the batch being scored
        # gathering (see the module docstring): requests the window waits for, learned from the last
        # one (bulk requests within it or while its batch runs), that window's end while submit()
        # may still count late ones into it, and whether its batch runs
        self._group = max_batch_size if gather_s > 0 else 1
        self._window_end_at: float | None = None
        self._window_batch_running = False
        self._idle_since = -math.inf  # clock() when the last batch ended
        self._stopping = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.setup_result: Any = None  # what start()'s setup returned

    # ---- the adapter's side -------------------------------------------------------------------
    def start(self, setup: Callable[[], Any] | None = None) -> "Scheduler":
        """Start the scheduler's thread; with `setup`, that thread first runs setup() (start()
        waits for it, re-raises what it raised and returns its result through `setup_result`).

        Why the engine should be built where it runs: each thread that opens OpenMP parallel
        regions gets its own team of OpenMP threads, kept for the process's life. An engine built
        (calibration, route timing, self-check) on Triton's thread and run on this one leaves two
        teams on the 2 cores; libgomp then makes its waiting threads sleep almost at once instead
        of spinning, and every one of a forward's ~300 parallel regions pays for waking them:
        measured 322-407 ms per request on (a) against 293-305 ms with the engine built and run on
        one thread (AMD EPYC, 2 cores)."""
        ready = threading.Event()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                if setup is not None:
                    outcome["result"] = setup()
            except BaseException as exc:  # handed to start()'s caller, and the thread ends
                outcome["error"] = exc
                return
            finally:
                ready.set()
            self._serve()

        self._thread = threading.Thread(target=run, name="prism-scheduler", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in outcome:
            raise outcome["error"]
        self.setup_result = outcome.get("result")
        return self

    def submit(self, item, urgent: bool = False, rows: int = 1, prefix: Sequence[int] = ()) -> Rejection | None:
        """Queue `item` (`rows`, `prefix`: see Ticket), or refuse it (returned, not passed to
        reject(): the caller answers it)."""
        with self._cond:
            now = self.clock()
            if self._stopping:
                return Rejection("stopping", "the decision model is being unloaded; retry on another replica", 1, urgent)
            answered_in = self.expected_answer_s(urgent, now)
            if self._busy() and answered_in > self.planned_s:
                retry = retry_hint(answered_in - self.planned_s)
                lane = "urgent" if urgent else "bulk"
                return Rejection("door", (
                    f"overloaded: a {lane} request now would wait about {answered_in:.1f} s for its answer "
                    f"({self._ahead(urgent)} queued ahead of it), more than the {self.bound_s:g} s bound allows "
                    f"(prism serve --max-queue-wait-s); retry after {retry} s"), retry, urgent)
            if not urgent and self._window_end_at is not None:
                if now <= self._window_end_at or self._window_batch_running:
                    self._group = min(self._group + 1, self.max_batch_size)  # sent with the last window's, late
                else:
                    self._window_end_at = None
            self._lanes[urgent].append(Ticket(item, urgent, now, rows, prefix))
            self._cond.notify()
            return None

    def expected_answer_s(self, urgent: bool, now: float) -> float:
        """Seconds until a request submitted now would be answered: the rest of the running batch,
        then the queued requests it does not overtake and itself, at the measured rate."""
        running_left = 0.0
        if self._running is not None:
            started, size = self._running
            running_left = max(0.0, started + size * self.seconds_per_request - now)
        return running_left + (self._ahead(urgent) + 1) * self.seconds_per_request

    def _ahead(self, urgent: bool) -> int:
        """Queued requests a new one of this lane would not overtake: urgent ones, and for a bulk
        request the bulk ones too."""
        return len(self._lanes[True]) + (0 if urgent else len(self._lanes[False]))

    def queued(self) -> int:
        with self._cond:
            return len(self._lanes[True]) + len(self._lanes[False])

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the running batch, refuse what is still queued ("stopping"), end the thread."""
        with self._cond:
            self._stopping = True
            left = [*self._lanes[True], *self._lanes[False]]
            for lane in self._lanes.values():
                lane.clear()
            self._cond.notify_all()
        for ticket in left:
            self.reject(ticket.item, Rejection("stopping", "the decision model is being unloaded; retry", 1,
                                               ticket.urgent))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the scheduler's thread --------------------------------------------------------------
    def _busy(self) -> bool:
        return self._running is not None or bool(self._lanes[True]) or bool(self._lanes[False])

    def _pick(self) -> tuple[list[Ticket], bool]:
        """Under the lock: the tickets the next batch would hold, and whether a limit stopped it
        (full): the urgent lane's first tickets, or where it is empty the bulk lane's, in order,
        within max_batch_size and max_batch_rows. A batch with urgent requests takes no bulk ones:
        they would make the urgent ones wait for their rows too."""
        picked, rows = [], 0
        for lane in (self._lanes[True], self._lanes[False]):
            if picked:  # urgent requests picked: no bulk ones, and no waiting to gather more
                return picked, True
            for ticket in lane:
                if len(picked) == self.max_batch_size:
                    return picked, True
                more = new_rows(ticket, picked)
                if picked and self.max_batch_rows and rows + more > self.max_batch_rows:
                    return picked, True
                picked.append(ticket)
                rows += more
        return picked, len(picked) == self.max_batch_size

    def _next_batch(self) -> tuple[list[Ticket], list[Ticket]] | None:
        """Under the lock: (batch to score, overdue tickets) once there is work, None to stop."""
        while not (self._lanes[True] or self._lanes[False]):
            if self._stopping:
                return None
            self._cond.wait()
        while True:  # gathering: see the module docstring
            if self._stopping:  # stop() has answered what was queued
                return None
            picked, full = self._pick()
            left = self._window_end() - self.clock()
            if full or left <= 0 or len(picked) >= self._group:
                break
            self._cond.wait(left)
        self._learn_from_gathering(picked)
        for ticket in picked:  # the picked tickets are the first of their lanes
            self._lanes[ticket.urgent].popleft()
        now = self.clock()
        expected = len(picked) * self.seconds_per_request
        batch, overdue = [], []
        for ticket in picked:
            ticket.waited = now - ticket.arrived
            late = ticket.waited + expected > self.planned_s and ticket.waited > BACKSTOP_GRACE * self.bound_s
            (overdue if late else batch).append(ticket)
        self._running = (now, len(batch)) if batch else None
        self._window_batch_running = self._window_batch_running and bool(batch)
        return batch, overdue

    def _window_end(self) -> float:
        """Under the lock, with requests queued: when the gathering window closes -- gather_s after
        the first queued request's arrival, stretched to gather_s after each bulk request that
        arrived within it (in arrival order), at most GATHER_SPAN gather_s after the first."""
        first = min(lane[0].arrived for lane in self._lanes.values() if lane)
        end, cap = first + self.gather_s, first + GATHER_SPAN * self.gather_s
        for ticket in self._lanes[False]:
            if ticket.arrived > end:
                break
            end = min(max(end, ticket.arrived + self.gather_s), cap)
        return end

    def _learn_from_gathering(self, picked: list[Ticket]) -> None:
        """Under the lock, as a bulk batch that an idle engine starts is formed (one of requests that
        queued behind a batch, or an urgent one, which never gathers, says nothing about groups):
        the bulk requests within its window are the group the next window waits for; submit() adds
        those that arrive later within it or while the batch formed now runs."""
        first = picked[0]
        if first.urgent or first.arrived < self._idle_since:
            return
        end = self._window_end()
        self._group = sum(1 for t in self._lanes[False] if t.arrived <= end)
        self._window_end_at = end
        self._window_batch_running = True  # until _serve() ends the batch formed now

    def _serve(self) -> None:
        while True:
            with self._cond:
                work = self._next_batch()
            if work is None:
                return
            batch, overdue = work
            for ticket in overdue:
                retry = retry_hint(len(batch) * self.seconds_per_request)
                self.reject(ticket.item, Rejection("overdue", (
                    f"overloaded: waited {ticket.waited:.1f} s in the queue and could no longer be answered "
                    f"within the {self.bound_s:g} s bound (prism serve --max-queue-wait-s); retry after {retry} s"),
                    retry, ticket.urgent))
            if not batch:
                continue
            start = self.clock()
            try:
                self.run_batch(batch)  # answers every ticket of the batch, also on errors
            except Exception as exc:  # a bug in run_batch: answer its tickets, keep the thread alive
                for ticket in batch:
                    self.reject(ticket.item, Rejection("error", f"internal error: {exc!r}", 1, ticket.urgent))
            finally:
                per_request = (self.clock() - start) / len(batch)
                with self._cond:
                    self.seconds_per_request = (per_request if self.seconds_per_request == 0.0 else
                                                (1 - EWMA_WEIGHT) * self.seconds_per_request
                                                + EWMA_WEIGHT * per_request)
                    self._running = None
                    self._window_batch_running = False
                    self._idle_since = self.clock()
