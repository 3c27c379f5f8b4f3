"""The faults a drill injects, where, and the outcome each one must have.

``--faults`` takes a comma-separated list of ``KIND@WHERE`` items, each optionally ending in
``#CYCLE``; items without a cycle take cycles 1, 2, 3, ... in order (skipping those taken).
Every fault hits the drill's first engine (a ``kill-controller`` hits the controller). What
each one must lead to is ``expected(kind, where)``; the drill checks it, handles the
aftermath (``after``), and checks that the engine serves again. Neighbours: ``runner`` (how
each is injected), ``agent.failpoints`` (the engine-side half).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt_controller.errors import UsageError

HOOK_POINTS = ("pre-prepare", "post-drain", "post-release", "dump", "post-dump", "pre-restore",
               "post-restore", "post-resume", "on-fail")

#: kind -> where it can strike
WHERE: dict[str, tuple[str, ...]] = {
    "kill-engine": ("drain", "release", "capture", "rewake", "resume"),
    "stall-agent": ("drain", "release", "rewake", "resume"),
    "fail-hook": HOOK_POINTS,
    "hang-hook": HOOK_POINTS,
    "kill-controller": ("preparing", "prepared", "restoring"),
    "corrupt-weight": ("rewake",),
    "residual": ("release",),
}


@dataclass(frozen=True)
class Expected:
    #: operation statuses that are right
    status: tuple[str, ...]
    #: the engine right after the operation: running | failed | gone (process dead)
    state: str
    #: the error kind on the engine's outcome (None: no error, or not checked)
    error: str | None
    #: what the drill does next: none | replace (start the engine again) | recover (restore
    #: from FAILED) | reconcile (wait for the controller's reconciler) | restart-controller
    after: str
    text: str


# point -> (state, status) after a cycle whose hook at that point fails (product.md §4); a
# failing on-fail hook needs a failure to run, so a failing post-restore hook comes with it
_HOOK_EFFECTS = {
    "pre-prepare": ("running", "failed", "veto: the engine stays RUNNING"),
    "post-drain": ("running", "rolled_back", "rolled back to RUNNING"),
    "post-release": ("running", "rolled_back", "rolled back to RUNNING"),
    "dump": ("running", "rolled_back", "rolled back to RUNNING (the process lives)"),
    "post-dump": ("running", "rolled_back", "rolled back to RUNNING (the process lives)"),
    "pre-restore": ("failed", "failed", "FAILED; recovered with restore"),
    "post-restore": ("failed", "failed", "FAILED; recovered with restore"),
    "post-resume": ("running", "succeeded", "logged only: the cycle succeeds"),
    "on-fail": ("failed", "failed", "logged only (after a failing post-restore): FAILED; "
                "recovered with restore"),
}


def expected(kind: str, where: str) -> Expected:
    if kind == "kill-engine":
        return Expected(("failed",), "gone", None, "replace",
                        "the operation fails within the heartbeat timeout; the engine is "
                        "started again")
    if kind == "stall-agent":
        return Expected(("failed",), "unknown", "UnreachableError", "reconcile",
                        "the operation fails within the heartbeat timeout (exit 4); when the "
                        "agent answers again the controller's reconciler brings it back to "
                        "RUNNING")
    if kind in ("fail-hook", "hang-hook"):
        state, status, text = _HOOK_EFFECTS[where]
        if kind == "fail-hook" or where in ("post-resume", "on-fail"):
            error = "HookError"
        else:
            error = "HookTimeoutError"
        return Expected((status,), state, None if status == "succeeded" else error,
                        "recover" if state == "failed" else "none", text)
    if kind == "kill-controller":
        return Expected(("interrupted",), "running", None, "restart-controller",
                        "the controller restarts, reconciles, and the engine is RUNNING")
    if kind == "corrupt-weight":
        return Expected(("failed",), "failed", "VerificationError", "recover",
                        "the bit-exact check fails the restore: FAILED with the tensor named; "
                        "restore (recovery) reloads the weights from their file and checks "
                        "them again")
    return Expected(("rolled_back",), "running", "ResidualOverBudgetError", "none",
                    "the prepare fails on the budget and rolls back to RUNNING")


@dataclass(frozen=True)
class Fault:
    kind: str
    where: str
    cycle: int

    def __str__(self) -> str:
        return f"{self.kind}@{self.where}"

    @property
    def expected(self) -> Expected:
        return expected(self.kind, self.where)


_ITEM = re.compile(r"^(?P<kind>[a-z-]+)@(?P<where>[a-z-]+)(?:#(?P<cycle>\d+))?$")


def parse_faults(spec: str, cycles: int) -> list[Fault]:
    """``UsageError`` naming the bad item; a fault per cycle at most, within ``cycles``."""
    items = [part.strip() for part in spec.split(",") if part.strip()]
    placed: dict[int, tuple[str, str]] = {}
    loose: list[tuple[str, str]] = []
    for item in items:
        m = _ITEM.match(item)
        if not m:
            raise UsageError(f"bad fault {item!r}: write KIND@WHERE[#CYCLE]", fault=item,
                             kinds=sorted(WHERE))
        kind, where = m["kind"], m["where"]
        if kind not in WHERE:
            raise UsageError(f"unknown fault kind {kind!r}; kinds: {', '.join(WHERE)}",
                             fault=item)
        if where not in WHERE[kind]:
            raise UsageError(f"{kind} strikes at {', '.join(WHERE[kind])}, not {where!r}",
                             fault=item)
        if m["cycle"] is None:
            loose.append((kind, where))
            continue
        cycle = int(m["cycle"])
        if not 1 <= cycle <= cycles:
            raise UsageError(f"fault {item!r}: cycle {cycle} is not in 1..{cycles}", fault=item)
        if cycle in placed:
            raise UsageError(f"two faults for cycle {cycle}", fault=item)
        placed[cycle] = (kind, where)
    free = (c for c in range(1, cycles + 1) if c not in placed)
    for kind, where in loose:
        cycle = next(free, None)
        if cycle is None:
            raise UsageError(f"{len(items)} faults need at least as many cycles; "
                             f"--cycles is {cycles}", faults=len(items), cycles=cycles)
        placed[cycle] = (kind, where)
    return [Fault(k, w, c) for c, (k, w) in sorted(placed.items())]


def every_fault() -> str:
    """A spec with every kind at every place (what the fault test drives)."""
    return ",".join(f"{kind}@{where}" for kind, places in WHERE.items() for where in places)
