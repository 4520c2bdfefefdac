"""The side-by-side benchmark's request plumbing: what it times must be what it says it times."""
import threading

from side_by_side import VLLM_TICKETS, prism_tickets, throughput, throughput_tickets

LEVELS = (1, 4, 8)


def test_throughput_tickets_are_new_at_every_level_and_for_every_server():
    """A ticket sent twice is a prefix-cache hit for a server that keeps one (vLLM's 4- and
    8-caller rates were once inflated that way): no material may repeat anywhere in a run."""
    bases = [prism_tickets(i) for i in range(3)] + [VLLM_TICKETS]  # the bench's three servers, and vLLM's
    materials = [r["material"] for base in bases for c in LEVELS for ticket in throughput_tickets(base, c) for r in ticket]
    assert len(materials) == len(set(materials)) == len(bases) * sum(2 * c + 2 for c in LEVELS)


def test_throughput_sends_every_request_once_with_the_given_concurrency():
    sent, active, peak = [], [0], [0]
    lock = threading.Lock()
    release = threading.Barrier(4)

    def send(request):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        if request < 4:
            release.wait(timeout=10)  # the first four overlap: all four callers are busy at once
        with lock:
            active[0] -= 1
            sent.append(request)

    assert throughput(send, 4, list(range(10))) > 0
    assert sorted(sent) == list(range(10)) and peak[0] == 4
