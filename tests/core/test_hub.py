"""The hub: a fan-out's items each in a greenlet on the calling thread, all waits at once."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from ckpt_controller import hub
from support.timing import scaled


@pytest.fixture
def echo(tmp_path):
    """A ROUTER that answers each message after ``delay`` seconds, on a thread of its own;
    yields (endpoint, set_delay)."""
    ctx = zmq.Context.instance()
    endpoint = f"ipc://{tmp_path}/echo.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    delay = [0.0]
    stop = threading.Event()

    def serve() -> None:
        pending = []
        while not stop.is_set():
            if router.poll(5):
                pending.append((time.monotonic() + delay[0], router.recv_multipart()))
            now = time.monotonic()
            for item in [x for x in pending if x[0] <= now]:
                router.send_multipart(item[1])
                pending.remove(item)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield endpoint, lambda s: delay.__setitem__(0, s)
    stop.set()
    t.join(scaled(5))
    router.close(linger=0)


def _ask(endpoint: str, timeout_s: float = 5.0) -> tuple[bytes | None, int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(b"ping")
        ready = hub.poll((sock,), timeout_s)
        return (sock.recv() if ready else None), threading.get_ident()
    finally:
        sock.close(linger=0)


def test_many_waits_overlap_on_the_calling_thread(echo):
    endpoint, delay = echo
    delay(0.3)
    answers = {}
    start = time.monotonic()
    hub.each(lambda i: answers.__setitem__(i, _ask(endpoint)), range(40), 40)
    took = time.monotonic() - start
    assert sorted(answers) == list(range(40))
    assert all(reply == b"ping" for reply, _ in answers.values())
    # one thread did all forty, and they waited together: about one delay, not forty
    assert {tid for _, tid in answers.values()} == {threading.get_ident()}
    assert took < scaled(0.3 * 10, below=0.3 * 40), took


def test_at_most_bounds_how_many_run_at_once():
    running, peak, order = [0], [0], []

    def item(i: int) -> None:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        hub.sleep(0.02)
        order.append(i)
        running[0] -= 1

    hub.each(item, list(range(12)), 3)
    assert peak[0] == 3 and sorted(order) == list(range(12))


def test_a_wait_that_runs_out_returns_nothing(echo):
    endpoint, delay = echo
    delay(5.0)
    start = time.monotonic()
    got = []
    hub.each(lambda _: got.append(_ask(endpoint, timeout_s=0.2)[0]), range(3), 3)
    assert got == [None, None, None] and time.monotonic() - start < scaled(2.0, below=5.0)


def test_blocking_work_runs_off_the_loop_while_the_others_go_on():
    seen = []

    def item(i: int) -> None:
        if i == 0:
            tid = hub.blocking(lambda: (time.sleep(0.4), threading.get_ident())[1])
            seen.append(("blocked", tid, time.monotonic()))
        else:
            hub.sleep(0.05)
            seen.append(("slept", threading.get_ident(), time.monotonic()))

    start = time.monotonic()
    hub.each(item, range(3), 3)
    kinds = [k for k, _, _ in seen]
    assert kinds == ["slept", "slept", "blocked"]  # the sleepers did not wait for the block
    blocked_tid = seen[-1][1]
    assert blocked_tid != threading.get_ident()  # the blocking call ran on another thread
    assert seen[0][2] - start < 0.3


def test_an_item_that_raises_ends_the_fan_out_with_its_error():
    started = []

    def item(i: int) -> None:
        started.append(i)
        hub.sleep(0.01)
        if i == 1:
            raise ValueError("item 1 failed")

    with pytest.raises(ValueError, match="item 1 failed"):
        hub.each(item, list(range(10)), 2)
    assert len(started) < 10  # the rest were not begun

    def blocked(_: int) -> None:
        hub.blocking(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):  # raised in the greenlet that asked
        hub.each(blocked, [0, 1], 2)


def test_outside_a_hub_and_inside_one_the_plain_thing_is_done(echo):
    endpoint, delay = echo
    assert hub.current() is None
    assert hub.blocking(lambda: threading.get_ident()) == threading.get_ident()
    assert _ask(endpoint)[0] == b"ping"  # a plain poll
    inner = []

    def outer(i: int) -> None:
        assert hub.current() is not None
        # a fan-out inside a fan-out runs its items one after the other, in this greenlet
        hub.each(lambda j: inner.append((i, j)), [0, 1, 2], 3)

    hub.each(outer, [0, 1], 2)
    assert sorted(inner) == [(i, j) for i in (0, 1) for j in (0, 1, 2)]
    assert hub.current() is None


def test_a_job_that_ends_as_its_hub_closes_writes_to_no_closed_file(monkeypatch):
    """A blocking job tells the hub it ended, then wakes it; a hub that saw the first and
    closed before the second must not leave the job writing to a closed (or reused) file."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    real_append = hub.deque.append

    class SlowWake(hub.deque):  # the job's thread pauses between its two steps
        def append(self, item):
            real_append(self, item)
            if threading.current_thread().name == "hub-job":
                time.sleep(0.002)

    monkeypatch.setattr(hub, "deque", SlowWake)

    def item(i: int, done: list) -> None:
        if i == 0:
            hub.blocking(lambda: None)
            done.append(True)
        else:  # wakes the loop often, so it finds the ended job before the wake-up; ends
            while not done:  # right after the job's greenlet, and the hub closes
                hub.sleep(0.0002)

    for _ in range(30):
        done: list = []
        hub.each(lambda i: item(i, done), [0, 1], 2)
        time.sleep(0.005)  # the job thread's wake-up comes after its hub closed
    assert errors == []


def test_gathered_items_are_flushed_once_per_round_in_order_and_at_the_end():
    """``gather`` under a hub: every item a round made, in the order made, in one flush
    before the hub waits; what the last round made, when the fan-out ends. Outside a hub
    each item is flushed at once."""
    flushes: list[list[str]] = []
    key = object()

    def item(i: int) -> None:
        hub.gather(key, f"{i}a", flushes.append)
        hub.gather(key, f"{i}b", flushes.append)
        hub.sleep(0.01)  # every lane waits: the round ends here
        hub.gather(key, f"{i}c", flushes.append)

    hub.each(item, [0, 1, 2], at_most=3)
    assert flushes[0] == ["0a", "0b", "1a", "1b", "2a", "2b"]
    assert sorted(x for f in flushes[1:] for x in f) == ["0c", "1c", "2c"]
    assert sum(map(len, flushes)) == 9 and len(flushes) <= 4

    flushes.clear()
    hub.gather(key, "alone", flushes.append)
    assert flushes == [["alone"]]


def test_a_fan_out_that_fails_still_flushes_what_it_gathered():
    flushes: list[list[int]] = []

    def item(i: int) -> None:
        hub.gather("k", i, flushes.append)
        if i == 1:
            raise ValueError("boom")
        hub.sleep(0.01)

    with pytest.raises(ValueError):
        hub.each(item, [0, 1], at_most=2)
    assert sorted(x for f in flushes for x in f) == [0, 1]
