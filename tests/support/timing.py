"""Waiting in tests: poll for a condition instead of sleeping a fixed time.

Neighbours: ``processes`` and ``net`` wait through ``wait_until``.
"""

from __future__ import annotations

import time


def wait_until(condition, timeout_s: float = 10.0, what: str = "the condition",
               every_s: float = 0.02):
    """Poll ``condition()`` until it returns something true (returned) or ``timeout_s``
    passes (``AssertionError`` naming ``what``): a readiness wait instead of a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)
