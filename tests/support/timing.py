"""Time limits in tests that hold on a loaded host: waits poll for a condition
(``wait_until``), and a bound on elapsed wall time is multiplied by how loaded the host is
(``scaled``), never a bare number of seconds.

The factor (``slack()``) is ``$CKPT_TEST_SLACK`` when set (a number, at least 1), else the
last minute's load average per CPU this process may run on, at least 1 and at most
``MAX_SLACK``; it is read at each call, so a bound checked after a busy stretch gets that
stretch's factor. Only upper bounds ("within N s") are scaled: a lower bound ("waited at
least N s") is what the code under test promises, and stays as written. Where an upper bound
tells one behaviour from a much slower one (heartbeats within seconds, not a 300 s deadline;
one timeout, not two), ``below=`` keeps the scaled bound under the slower one, so the test
still tells them apart. Code that takes a clock is tested on ``ckpt_controller.clock``'s
``ManualClock`` instead, with no wall time at all.

Neighbours: ``processes``, ``net`` and ``cli`` wait through these; docs/testing.md.
"""

from __future__ import annotations

import os
import time

#: the most a bound is stretched by the host's load (a host loaded past this many runnable
#: processes per CPU fails its tests, as it should: nothing there is measured any more)
MAX_SLACK = 4.0
#: a scaled bound stays under this share of the slower behaviour it must not be taken for
BELOW_SHARE = 0.9


def slack() -> float:
    """How many times longer than on an idle host things may take now (see the module)."""
    said = os.environ.get("CKPT_TEST_SLACK")
    if said:
        factor = float(said)
        if not factor >= 1:
            raise ValueError(f"CKPT_TEST_SLACK must be a number >= 1, got {said!r}")
        return factor
    load = os.getloadavg()[0] / len(os.sched_getaffinity(0))
    return min(MAX_SLACK, max(1.0, load))


def scaled(seconds: float, *, below: float | None = None) -> float:
    """``seconds`` times ``slack()``; with ``below`` (the time of the behaviour the bound must
    not admit), at most ``BELOW_SHARE`` of it, but never less than ``seconds``."""
    limit = seconds * slack()
    if below is not None:
        limit = min(limit, max(seconds, below * BELOW_SHARE))
    return limit


def deadline_in(seconds: float) -> float:
    """A ``time.monotonic()`` deadline ``scaled(seconds)`` from now, for a test's own loop."""
    return time.monotonic() + scaled(seconds)


def wait_until(condition, timeout_s: float = 10.0, what: str = "the condition",
               every_s: float = 0.02):
    """Poll ``condition()`` until it returns something true (returned) or ``timeout_s``
    (``scaled``) passes (``AssertionError`` naming ``what``): a readiness wait instead of a
    fixed sleep."""
    limit = scaled(timeout_s)
    deadline = time.monotonic() + limit
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {limit:.1f} s"
        time.sleep(every_s)
