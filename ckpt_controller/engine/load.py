"""A load generator for the reference engine: requests at a fixed rate for a duration.

Prompts and lengths come from a seeded RNG and request ids from the index, so two runs send
the same requests; the digest of all completed outputs lets two runs (e.g. with and without a
checkpoint cycle in the middle) be compared. After the sending phase it waits up to
``settle_s`` for every request to end; a request still without an end then is ``lost``.
The rate, the durations and the vocabulary size are checked (``values``: NaN, infinity, zero
or absurd values are a ``UsageError``) before anything is sent; an engine nobody serves is an
``UnreachableError`` within about a second (the client's first contact).
Neighbours: ``client``; ``cli`` (``ckptctl load``), tests, drills and benchmarks.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ckpt_controller.engine.client import Completion, EngineClient
from ckpt_controller.values import COUNT, DURATION, DURATION_OR_ZERO, RATE, check
from ckpt_controller.vocab import FinishReason


@dataclass
class LoadReport:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    errored: int = 0
    rejected: int = 0
    #: of the rejected: refused by a full engine (``OverloadedError``), not for its state
    shed: int = 0
    lost: int = 0
    duration_s: float = 0.0
    #: sha256 over {request id: tokens} of every completed (stop/length) request
    digest: str = ""
    lost_ids: list[str] = field(default_factory=list)
    latency_p50_s: float | None = None
    latency_max_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class LoadControl:
    """Tells a running ``run_load`` (from another thread) that its engine process died: its
    requests without an end then end with an error instead of waiting to be counted lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lost: str | None = None
        #: ids ended because the engine died
        self.ended_by_loss: list[str] = []

    def engine_lost(self, reason: str) -> None:
        with self._lock:
            self._lost = reason

    def _apply(self, client: EngineClient) -> None:
        with self._lock:
            reason, self._lost = self._lost, None
        if reason is not None:
            self.ended_by_loss += client.engine_lost(reason)


def prompt_for(seed: int, index: int, vocab_size: int) -> tuple[list[int], int]:
    rng = random.Random(seed * 1_000_003 + index)
    prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(4, 24))]
    return prompt, rng.randint(16, 128)


def run_load(
    endpoint: str | Callable[[], EngineClient],
    *,
    rate: float,
    duration_s: float,
    seed: int = 0,
    vocab_size: int = 1024,
    settle_s: float = 60.0,
    on_progress: Callable[[LoadReport], None] | None = None,
    control: LoadControl | None = None,
) -> tuple[LoadReport, dict[str, Completion]]:
    rate = check(RATE, rate, "rate")
    duration_s = check(DURATION, duration_s, "duration_s")
    settle_s = check(DURATION_OR_ZERO, settle_s, "settle_s")
    vocab_size = check(COUNT, vocab_size, "vocab_size")
    report = LoadReport()
    control = control or LoadControl()
    # an endpoint, or what makes the client (``EngineClient.for_engine``: follow an engine)
    with (EngineClient(endpoint) if isinstance(endpoint, str) else endpoint()) as client:
        start = time.monotonic()
        # exactly rate x duration requests, the i-th at start + i / rate: two runs send the
        # same ones (an accumulated float interval could squeeze one more in before the end)
        total = math.ceil(rate * duration_s - 1e-9)  # those that start before the end
        end_send = start + duration_s
        i = 0
        last_progress = start
        # until every request is sent (one overdue after a stall of this process goes out
        # at once: the count never depends on the scheduler) and the duration is over
        while i < total or time.monotonic() < end_send:
            now = time.monotonic()
            while i < total and start + i / rate <= now:
                prompt, max_tokens = prompt_for(seed, i, vocab_size)
                client.submit(prompt, max_tokens, request_id=f"load-{seed}-{i}")
                i += 1
            next_send = start + i / rate if i < total else end_send
            client.poll(max(0.0, min(next_send, end_send) - time.monotonic()))
            control._apply(client)
            if on_progress and time.monotonic() - last_progress >= 1.0:
                last_progress = time.monotonic()
                on_progress(_tally(report, client.requests, i))
        settle_end = time.monotonic() + settle_s
        while time.monotonic() < settle_end and not all(c.ended for c in client.requests.values()):
            client.poll(0.2)
            control._apply(client)
        control._apply(client)
        report = _tally(report, client.requests, i)
        report.duration_s = time.monotonic() - start
        return report, dict(client.requests)


def _tally(report: LoadReport, requests: dict[str, Completion], sent: int) -> LoadReport:
    report.sent = sent
    done = {rid: c.token_ids for rid, c in requests.items()
            if c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)}
    report.completed = len(done)
    report.aborted = sum(c.finish_reason == FinishReason.ABORT for c in requests.values())
    report.errored = sum(c.finish_reason == FinishReason.ERROR for c in requests.values())
    report.rejected = sum(c.rejected is not None for c in requests.values())
    report.shed = sum(c.rejected is not None and c.rejected.kind == "OverloadedError"
                      for c in requests.values())
    report.lost_ids = sorted(rid for rid, c in requests.items() if not c.ended)
    report.lost = len(report.lost_ids)
    report.digest = hashlib.sha256(json.dumps(done, sort_keys=True).encode()).hexdigest()
    lat = sorted(c.ended_at - c.sent_at for c in requests.values()
                 if c.ended_at is not None and c.rejected is None)
    if lat:
        report.latency_p50_s = lat[len(lat) // 2]
        report.latency_max_s = lat[-1]
    return report


#: replayed requests in flight at once: well inside a reference engine's default queue
REPLAY_WINDOW = 64


def replay(endpoint: str, seed: int, request_ids, *, vocab_size: int = 1024,
           timeout_s: float = 120.0) -> dict[str, list[int]]:
    """Send the load requests ``request_ids`` (``load-<seed>-<i>``) again to a RUNNING engine,
    ``REPLAY_WINDOW`` at a time; returns each one's tokens. What a cycle's outputs are compared
    against. A request the engine sheds or refuses for a while (a retryable rejection) is sent
    again; any other rejection is raised: an empty output would read as a mismatch."""
    todo = deque(request_ids)
    flying: dict[str, str] = {}  # replay request id -> load request id
    tries = itertools.count()
    out: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    with EngineClient(endpoint) as client:
        while todo or flying:
            while todo and len(flying) < REPLAY_WINDOW:
                rid = todo.popleft()
                prompt, max_tokens = prompt_for(seed, int(rid.rsplit("-", 1)[1]), vocab_size)
                flying[client.submit(prompt, max_tokens,
                                     request_id=f"replay-{next(tries)}-{rid}")] = rid
            if time.monotonic() > deadline:
                raise TimeoutError(f"replayed requests did not all end in {timeout_s:.0f} s "
                                   f"({len(todo) + len(flying)} left)")
            for c in client.poll(0.2):
                rid = flying.pop(c.request_id, None)
                if rid is None:
                    continue
                if c.rejected is None:
                    out[rid] = c.token_ids
                    continue
                err = c.rejected.to_exception()
                if not err.retryable:
                    raise err
                todo.append(rid)  # shed by a full engine (or not RUNNING yet): again later
        return out
