"""The faults a drill injects, where, and the outcome each one must have.

``--faults`` takes a comma-separated list of ``KIND@WHERE`` items, each optionally ending in
``#CYCLE``; items without a cycle take cycles 1, 2, 3, ... in order (skipping those taken).
Every fault hits the drill's first engine (a ``kill-controller`` hits the controller). What
each one must lead to is ``expected(kind, where)``; the drill checks it, handles the
aftermath (``after``), and checks that the engine serves again. What a hook fault must lead
to comes from the controller's own table (``controller.policy.HOOK_FAILURE``, each point's
plain row: a drill's hook fails where the cycle runs it), so the drill checks the policy the
controller applies, not a copy of it. Neighbours: ``runner`` (how each
is injected), ``agent.failpoints`` (the engine-side half), ``controller.policy``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckpt_controller.controller import policy
from ckpt_controller.errors import UsageError
from ckpt_controller.vocab import (
    CheckpointState,
    HookFailure,
    HookPoint,
    OperationKind,
    OperationStatus,
    PrepareStep,
    RestoreStep,
)

HOOK_POINTS = tuple(HookPoint)

#: kind -> where it can strike
WHERE: dict[str, tuple[str, ...]] = {
    "kill-engine": (PrepareStep.DRAIN, PrepareStep.RELEASE, OperationKind.CAPTURE,
                    RestoreStep.REWAKE, RestoreStep.RESUME),
    "stall-agent": (PrepareStep.DRAIN, PrepareStep.RELEASE, RestoreStep.REWAKE,
                    RestoreStep.RESUME),
    "fail-hook": HOOK_POINTS,
    "hang-hook": HOOK_POINTS,
    "kill-controller": (CheckpointState.PREPARING, CheckpointState.PREPARED,
                        CheckpointState.RESTORING),
    "corrupt-weight": (RestoreStep.REWAKE,),
    "residual": (PrepareStep.RELEASE,),
}


@dataclass(frozen=True)
class Expected:
    #: operation statuses that are right
    status: tuple[str, ...]
    #: the engine right after the operation: running | failed (``CheckpointState``), gone
    #: (process dead) or unknown (not asked)
    state: str
    #: the error kind on the engine's outcome (None: no error, or not checked)
    error: str | None
    #: what the drill does next: none | replace (start the engine again) | recover (restore
    #: from FAILED) | reconcile (wait for the controller's reconciler) | restart-controller
    after: str
    text: str


#: what a cycle whose hook fails does, by the table's word: (engine state, operation status,
#: what the report says)
_BY_POLICY = {
    HookFailure.VETO: (CheckpointState.RUNNING, OperationStatus.FAILED,
                       "veto: the engine stays RUNNING"),
    HookFailure.ROLLBACK: (CheckpointState.RUNNING, OperationStatus.ROLLED_BACK,
                           "rolled back to RUNNING (if its process lives)"),
    HookFailure.FAIL: (CheckpointState.FAILED, OperationStatus.FAILED,
                       "FAILED; recovered with restore"),
    HookFailure.LOG: (CheckpointState.RUNNING, OperationStatus.SUCCEEDED,
                      "logged only: the cycle succeeds"),
}
#: a failing on-fail hook needs a failure to run: a failing post-restore hook comes with it
#: (``runner``), so the cycle ends as that one says
RUNS_WITH = {HookPoint.ON_FAIL: HookPoint.POST_RESTORE}


def _hook_effect(point: HookPoint) -> tuple[str, str, str]:
    state, status, text = _BY_POLICY[policy.row(RUNS_WITH.get(point, point)).action]
    if point in RUNS_WITH:
        text = f"logged only (after a failing {RUNS_WITH[point]}): {text}"
    return state, status, text


#: point -> (state, status, text) after a cycle whose hook at that point fails (product.md §4)
_HOOK_EFFECTS = {point: _hook_effect(point) for point in HookPoint}


def expected(kind: str, where: str) -> Expected:
    if kind == "kill-engine":
        return Expected((OperationStatus.FAILED,), "gone", None, "replace",
                        "the operation fails within the heartbeat timeout; the engine is "
                        "started again")
    if kind == "stall-agent":
        return Expected((OperationStatus.FAILED,), "unknown", "UnreachableError", "reconcile",
                        "the operation fails within the heartbeat timeout (exit 4); when the "
                        "agent answers again the controller's reconciler brings it back to "
                        "RUNNING")
    if kind in ("fail-hook", "hang-hook"):
        state, status, text = _HOOK_EFFECTS[where]
        # the outcome's error is the failing hook's own, or the one it runs with (exit 7)
        hung = kind == "hang-hook" and where not in RUNS_WITH
        error = "HookTimeoutError" if hung else "HookError"
        return Expected((status,), state, None if status == OperationStatus.SUCCEEDED else error,
                        "recover" if state == CheckpointState.FAILED else "none", text)
    if kind == "kill-controller":
        return Expected((OperationStatus.INTERRUPTED,), CheckpointState.RUNNING, None,
                        "restart-controller",
                        "the controller restarts, reconciles, and the engine is RUNNING")
    if kind == "corrupt-weight":
        return Expected((OperationStatus.FAILED,), CheckpointState.FAILED, "VerificationError",
                        "recover",
                        "the bit-exact check fails the restore: FAILED with the tensor named; "
                        "restore (recovery) reloads the weights from their file and checks "
                        "them again")
    return Expected((OperationStatus.ROLLED_BACK,), CheckpointState.RUNNING,
                    "ResidualOverBudgetError", "none",
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
