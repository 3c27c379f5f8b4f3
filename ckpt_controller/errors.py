"""The error tree of ckpt-controller, sorted by what the caller does next.

Every error carries the facts a person needs to act (engine, state, step, deadline, ...)
in ``details`` and crosses the wire as ``(kind, message, details)``; ``from_wire`` turns it
back into the same class on the other side. Neighbours: ``protocol`` carries errors as
``ErrorReply``; ``cli`` maps ``exit_code`` to the process exit status.

    CkptError                          base; never raised itself
    +-- UsageError             exit 2  the caller asked for something malformed or impossible
    |   +-- ConfigError                a bad configuration value
    |   +-- InvalidTransitionError     a trigger not allowed in the current state
    |   +-- ImageError                 a CRIU image is damaged or not what was promised
    |   +-- EtcdRefusedError           etcd answered a fleet request with an error
    |   +-- UnsupportedError           the engine cannot do what was asked (says what it can)
    |   +-- CompatibilityError         an image needs what this host differs in (manifest)
    +-- ProtocolError          exit 2  a frame broke the wire contract
    |   +-- VersionMismatchError       the peer speaks another protocol version
    |   +-- DamagedRecordError         a fleet record in etcd cannot be read (names the key)
    +-- RejectedError          exit 1  admission closed: retry after ``retry_after_s`` (temporary)
    +-- BusyError              exit 1  another operation holds the engine (temporary)
    |   +-- NodeNameTakenError         another controller holds this node's name in etcd
    +-- StateDirError          exit 1  the controller's state dir cannot be written (disk full,
    |                                  read-only, I/O error): refused, nothing began
    +-- OperationError         exit 1  an operation ran and failed (it was rolled back or FAILED)
    |   +-- DrainError                 in-flight requests could not be drained as asked
    |   +-- MemoryError_               releasing or re-waking memory failed
    |   |   +-- ResidualOverBudgetError   memory left after release exceeds the budget
    |   |   +-- VerificationError         re-woken weights differ from the release checksum
    |   +-- EngineError                the engine's own callback raised
    |   +-- HookError                  a hook exited non-zero (or could not start)
    +-- DeadlineError          exit 3  a deadline passed (a failure, never a success)
    |   +-- HookTimeoutError           a hook ran past its timeout and was stopped
    +-- UnreachableError       exit 4  the peer did not answer (temporary: reconnect, retry)
    +-- OverloadedError        exit 4  the peer shed the request under load (temporary: retry
                                       after ``retry_after_s``; nothing of it ran)
"""

from __future__ import annotations

import enum
import json
from typing import Any, ClassVar


def described(exc: BaseException) -> str:
    """An unexpected exception as a person reads it: ``TypeError: what it said`` (its repr,
    ``TypeError('what it said')``, is Python's, not an operator's)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def plain(value: Any) -> str:
    """A detail as an operator reads it, never a Python repr: a word as it is (quoted, JSON
    style, only when it has spaces or punctuation that would blur it), an enum as its word,
    a list as ``a,b``, a number as written, a boolean as ``true``/``false``."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return ",".join(plain(v) for v in items) if items else "none"
    if isinstance(value, dict):
        return json.dumps(value, default=str, separators=(",", ":"))
    text = str(value)
    if not text or any(c in text for c in ' ,="()\n\t'):
        return json.dumps(text)
    return text


class CkptError(Exception):
    """Base of every error this project raises on purpose."""

    exit_code: ClassVar[int] = 1
    #: True when the same request may succeed later without any change by the caller.
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def __str__(self) -> str:
        if not self.details:
            return self.message
        facts = ", ".join(f"{k}={plain(v)}" for k, v in self.details.items() if v is not None)
        return f"{self.message} ({facts})" if facts else self.message

    @property
    def kind(self) -> str:
        return type(self).__name__

    def __reduce__(self):  # pickling keeps details (multiprocessing, tests)
        return (_rebuild, (self.kind, self.message, self.details))


class UsageError(CkptError):
    """Raised when a request is malformed or impossible as asked. Fix the request; do not retry."""

    exit_code = 2


class ConfigError(UsageError):
    """Raised for a bad configuration value; ``details`` names the file, key and problem."""


class InvalidTransitionError(UsageError):
    """Raised when a trigger is not allowed in the current state; nothing changed.

    ``details``: ``state``, ``trigger``, ``allowed`` (the triggers that are allowed now).
    """


class BusyError(CkptError):
    """Raised when another operation holds the engine; ``details['holder']`` names it. Retry
    once it ended (or use the holder's id to wait for its result)."""

    retryable = True


class NodeNameTakenError(BusyError):
    """Raised when another controller holds this node's name in etcd (a second copy of the
    node, or this one's previous life whose lease has not expired yet); ``details['node']``.
    The node tries again each round: a restarted one waits out its old lease."""


class StateDirError(CkptError):
    """Raised when the controller cannot write its journal in its state dir (the disk is full,
    the file system read-only, an I/O error): the request is refused before anything began.
    ``details`` name the ``state_dir`` and the ``problem``; retry once it has room again."""


class ImageError(UsageError):
    """Raised when a CRIU image (or its shipped small files) is damaged or not what its dump
    promised; ``details`` names the file. Do not restore it: dump again."""


class EtcdRefusedError(UsageError):
    """Raised when etcd answered a fleet request with an error of its own (a request too
    large, a lease it does not know), not a member being down; ``details``: ``etcd`` (the
    member), ``said`` (its message)."""


class UnsupportedError(UsageError):
    """Raised, before anything moves, when the engine cannot do what was asked: its API has
    no such step (vLLM's ``/checkpoint/prepare`` keeps the weights, cannot escalate a ``wait``
    it began, and cannot leave FAILED). ``details``: ``api`` (what the engine is driven
    through), ``can`` (what it can do) and ``change`` (what to ask for instead)."""


class CompatibilityError(UsageError):
    """Raised before a restore (or a migration's restore) when its image's manifest records
    what this host differs in (CRIU, kernel, CPU, the engine's files, the model...); nothing
    was restored. ``details['differences']`` lists each (``field``, ``image``, ``here``);
    restore it where it matches, or accept the fields named (``--accept``)."""


class ProtocolError(CkptError):
    """Raised when a frame breaks the wire contract (malformed, truncated, oversized, unknown type)."""

    exit_code = 2


class VersionMismatchError(ProtocolError):
    """Raised when the peer speaks another protocol version; upgrade one side."""


class DamagedRecordError(ProtocolError):
    """Raised when a fleet record in etcd cannot be read: malformed, of a newer schema, or not
    the shape its key holds. ``details['key']`` names it; nothing that needs the record goes on
    (what does not need it is not affected). Repair or delete the key (docs/fleet.md)."""


class RejectedError(CkptError):
    """Raised by the admission gate: the engine is not RUNNING. Retry after ``retry_after_s``."""

    retryable = True


class OperationError(CkptError):
    """Raised when an operation ran and failed; ``details`` names the step. The engine was
    rolled back to RUNNING or is FAILED (``details['state']``)."""


class DrainError(OperationError):
    """Raised when in-flight requests could not be drained as the caller asked."""


class MemoryError_(OperationError):  # noqa: N801 - the builtin MemoryError means something else
    """Raised when releasing or re-waking registered memory failed."""


class ResidualOverBudgetError(MemoryError_):
    """Raised when the memory still held after release exceeds the configured budget."""


class VerificationError(MemoryError_):
    """Raised when re-woken weights differ from the checksum taken at release. Never ignored."""


class EngineError(OperationError):
    """Raised when one of the engine's own callbacks (abort, keep, pause, verify...) failed."""


class HookError(OperationError):
    """Raised when a hook exits non-zero (or cannot start: exit 127); ``details`` has the
    point, the path, the exit code and the tail of its output."""


class DeadlineError(CkptError):
    """Raised when a deadline passed. A timeout is a failure, never a success."""

    exit_code = 3


class HookTimeoutError(DeadlineError):
    """Raised when a hook ran past its timeout (it was stopped); same details as HookError."""


class UnreachableError(CkptError):
    """Raised when the peer did not answer in time or its socket broke. Reconnect and retry."""

    exit_code = 4
    retryable = True


class OverloadedError(CkptError):
    """Raised when a server sheds a request because a bounded queue of its is full (a burst of
    requests, or more slow work than its workers can take). Nothing of the request ran: retry
    after ``details['retry_after_s']``, ideally with some jitter."""

    exit_code = 4
    retryable = True


def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_KIND: dict[str, type[CkptError]] = {c.__name__: c for c in _all_subclasses(CkptError)}


def from_wire(kind: str, message: str, details: dict[str, Any] | None = None) -> CkptError:
    """Rebuild an error that crossed the wire; an unknown kind becomes an ``OperationError``."""
    cls = _BY_KIND.get(kind, OperationError)
    err = cls(message, **(details or {}))
    if cls is OperationError and kind != "OperationError":
        err.details.setdefault("remote_kind", kind)
    return err


def _rebuild(kind: str, message: str, details: dict[str, Any]) -> CkptError:
    return from_wire(kind, message, details)
