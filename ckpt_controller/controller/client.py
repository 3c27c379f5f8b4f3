"""A Python client for the controller, for orchestration scripts: ``ckptctl``'s operations as
methods with the same parameters.

    from ckpt_controller import ControllerClient

    with ControllerClient() as c:            # $CKPT_CONTROLLER, else the CLI's default
        result = c.cycle(["engine-a", "engine-b"], max_unavailable=1, drain="keep",
                         level=2, budget="2GiB", drain_timeout=30)
        c.restore(all_engines=True)          # every engine: said, never by naming none
        if result.status != "succeeded": ...

Each keyword is a flag of ``ckptctl prepare``/``cycle``/... under its Python name
(``--drain-timeout S`` is ``drain_timeout=S``, ``--budget SIZE`` is ``budget=``): a word
(``drain="wait"`` or ``DrainMode.WAIT``), a level (``2`` or ``ReleaseLevel.DISCARD``), seconds,
a size (``"512MiB"`` or bytes). One left ``None`` takes the controller's configured default, as
the CLI's does. A bad value is refused before anything is sent, with the CLI's rule
(``values``): ``UsageError`` naming the keyword and the value, exit code 2.

Operations return an ``OperationResult`` (per-engine outcomes, phases, drain and memory
reports, hook runs); refusals raise typed errors (``BusyError`` with the holder,
``UsageError`` for unknown engines, ``UnreachableError``: within about a second when nothing
serves the endpoint). Each operation carries an id (generated unless given); sending the same
id again returns the first result. Neighbours: ``rpc`` (transport), ``protocol``, ``values``
(the rules), ``vocab`` (the words), ``endpoints`` (the default endpoint), docs/client.md.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable

from ckpt_controller import protocol as p
from ckpt_controller.endpoints import check_name, default_controller_endpoint
from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.rpc import RpcClient, new_op_id
from ckpt_controller.values import (
    BYTES,
    COUNT,
    DURATION,
    MAX_NAME_LENGTH,
    MAX_TEXT_LENGTH,
    MAX_UNAVAILABLE,
    OP_ID,
    check,
    check_optional,
    shown,
)
from ckpt_controller.vocab import DrainMode, Escalation, OperationKind, ReleaseLevel

#: how long an operation may take before the client gives up waiting, when the controller's
#: heartbeats do not already bound the wait (they do once subscribed)
DEFAULT_OPERATION_TIMEOUT_S = 3600.0

Engines = Iterable[str] | str | None


def _word(words: type[enum.Enum], value, field: str):
    """``value`` as a member of ``words`` (the member, or its word or number), or
    ``UsageError`` naming ``field`` and the words allowed; ``None`` passes."""
    if value is None:
        return None
    try:
        if isinstance(value, bool) or (issubclass(words, int) and not isinstance(value, int)):
            raise ValueError(value)  # a level is a whole number: 2.0 is not 2, as on the CLI
        return words(value)
    except ValueError:  # policy: the caller's value, refused before sending (exit 2)
        allowed = ", ".join(repr(w.value) for w in words)
        raise UsageError(f"{field} = {shown(value)} is not one of {allowed}", field=field,
                         value=shown(value)) from None


def _engines(engines: Engines) -> list[str]:
    """A list of engine names (one name alone is a list of one; ``None``: all engines)."""
    if engines is None:
        return []
    names = [engines] if isinstance(engines, str) else list(engines)
    for name in names:
        try:
            check_name(name if isinstance(name, str) else "")
        except ConfigError:  # policy: a bad name is the caller's argument, not a config file
            raise UsageError(f"engines: {shown(name)} is not an engine name (1 to "
                             f"{MAX_NAME_LENGTH} letters, digits, '.', '_', '-')",
                             field="engines", value=shown(name)) from None
    return names


def _chosen(engines: Engines, all_engines: bool) -> list[str]:
    """The engines an operation acts on: those named, or every one with ``all_engines``
    (the CLI's ``--all``); naming none acts on none (``UsageError``), as an empty list from a
    script's bug must not take every engine out."""
    if not isinstance(all_engines, bool):
        raise UsageError(f"all_engines = {shown(all_engines)} is not True or False",
                         field="all_engines", value=shown(all_engines))
    named = None if engines is None else _engines(engines)
    if all_engines:
        if named:
            raise UsageError("name the engines, or give all_engines=True (not both)",
                             field="engines", value=shown(engines))
        return []
    if not named:
        raise UsageError("name the engines, or give all_engines=True to act on every "
                         "configured engine", field="engines", value=shown(engines))
    return named


def _tags(tags, level) -> list[str] | None:
    if tags is None:
        return None
    if level is not None:
        raise UsageError("give level or tags, not both (as --level and --tags)", field="tags",
                         value=shown(tags))
    names = [tags] if isinstance(tags, str) else list(tags)
    if not names or not all(isinstance(t, str) and 0 < len(t) <= MAX_NAME_LENGTH
                            for t in names):
        raise UsageError(f"tags = {shown(tags)} is not a list of tag names", field="tags",
                         value=shown(tags))
    return names


class ControllerClient(RpcClient):
    """A connection to one controller. ``endpoint`` defaults to ``$CKPT_CONTROLLER``, else
    ``ipc://<runtime dir>/controller.sock`` (as ``ckptctl --controller``); the other keywords
    are the transport's (``timeout_s`` for a quick request, ``retries``, ``curve`` keys...).
    Use it in a ``with`` block, or call ``close()``."""

    unreachable_hint = ("is `ckptctl serve` running? name its endpoint with --controller or "
                        "$CKPT_CONTROLLER")
    peer = "the controller"

    def __init__(self, endpoint: str | None = None, **kw) -> None:
        kw.setdefault("name", "ckpt-controller-client")
        chosen = default_controller_endpoint() if endpoint is None else endpoint
        try:
            super().__init__(chosen, **kw)
        except ConfigError as err:
            # policy: a bad endpoint from $CKPT_CONTROLLER is the variable's to fix: say so
            # (ckptctl's --controller defaults to it too)
            from_env = os.environ.get("CKPT_CONTROLLER")
            if not from_env or chosen != from_env:
                raise
            raise ConfigError(f"$CKPT_CONTROLLER={from_env!r}: {err.message}",
                              **err.details, variable="CKPT_CONTROLLER") from None

    # ------------------------------------------------------------ reading

    def status(self, engines: Engines = None) -> p.ControllerStatusReply:
        """Each engine's state as its agent reports it (``ckptctl status``)."""
        return self.call(p.RequestType.STATUS, p.StatusCommand(call_id=0,
                                                               engines=_engines(engines)),
                         timeout_s=max(self.timeout_s, 10.0))

    def history(self, engine: str | None = None, op_id: str | None = None,
                limit: int = 50) -> p.HistoryReply:
        """Operations (newest first) and, for one ``engine`` or ``op_id``, their journal
        records (``ckptctl history``)."""
        return self.call(p.RequestType.HISTORY, p.HistoryCommand(
            call_id=0, engine=engine, op_id=op_id,
            limit=check(COUNT, limit, "limit")))

    def images(self, engines: Engines = None, *, prune: bool = False, keep: int | None = None,
               dry_run: bool = False) -> p.ImagesReply:
        """The capture images on disk of ``engines`` (``None``: every engine's), each with
        its size and why retention keeps it (``ckptctl images list``); with ``prune``, those
        it does not keep are removed (``keep``: the newest good images each engine keeps,
        default ``[images] keep``; ``dry_run``: only say which would go)."""
        for name, flag in (("prune", prune), ("dry_run", dry_run)):
            if not isinstance(flag, bool):
                raise UsageError(f"{name} = {shown(flag)} is not True or False", field=name,
                                 value=shown(flag))
        return self.call(p.RequestType.IMAGES, p.ImagesCommand(
            call_id=0, engines=_engines(engines), prune=prune, dry_run=dry_run,
            keep=check_optional(COUNT, keep, "keep")), timeout_s=max(self.timeout_s, 120.0))

    def compact_journal(self) -> p.CompactReply:
        """Compact the controller's journal now, to its ``[journal]`` bounds: what it forgot
        (``ckptctl journal compact``)."""
        return self.call(p.RequestType.COMPACT, p.CompactCommand(call_id=0),
                         timeout_s=max(self.timeout_s, 120.0))

    # ------------------------------------------------------------ operations
    # Each names its engines, or gives ``all_engines=True`` (the CLI's ``--all``): naming
    # none is refused, so that an empty list from a script's bug never takes every engine out.

    def prepare(self, engines: Engines = None, *, all_engines: bool = False,
                drain: DrainMode | str | None = None, drain_timeout: float | None = None,
                on_deadline: Escalation | str | None = None,
                level: ReleaseLevel | int | None = None, tags: Iterable[str] | None = None,
                budget: int | str | None = None, deadline: float | None = None,
                all_or_nothing: bool = True, op_id: str | None = None,
                timeout_s: float | None = None) -> p.OperationResult:
        """Drain and release ``engines`` (-> PREPARED).

        ``drain``: ``wait`` | ``abort`` | ``keep``; ``drain_timeout``: seconds a wait drain
        may take; ``on_deadline``: what it does then (``abort`` | ``keep`` | ``fail``);
        ``level`` 0 | 1 | 2 or ``tags`` (not both): what to release; ``budget``: the largest
        residual memory allowed after release (bytes, or ``"2GiB"``); ``deadline``: seconds
        per engine; ``all_or_nothing=False`` keeps the engines that prepared when another
        failed. ``None`` takes the controller's default."""
        return self._operation(OperationKind.PREPARE, engines, all_engines, op_id, timeout_s,
                               deadline, all_or_nothing=bool(all_or_nothing),
                               **self._prepare_params(drain, drain_timeout, on_deadline, level,
                                                      tags, budget))

    def capture(self, engines: Engines = None, *, all_engines: bool = False,
                deadline: float | None = None, op_id: str | None = None,
                timeout_s: float | None = None) -> p.OperationResult:
        """Run the dump hooks on PREPARED ``engines``; the result's ``image`` names it."""
        return self._operation(OperationKind.CAPTURE, engines, all_engines, op_id, timeout_s,
                               deadline)

    def restore(self, engines: Engines = None, *, all_engines: bool = False,
                image: str | None = None, deadline: float | None = None,
                op_id: str | None = None, timeout_s: float | None = None) -> p.OperationResult:
        """Re-wake PREPARED (or FAILED) ``engines`` (-> RUNNING); ``image``: the operation id
        whose image to restore (default: the one of the engine's generation)."""
        return self._operation(OperationKind.RESTORE, engines, all_engines, op_id, timeout_s,
                               deadline, image=check_optional(OP_ID, image, "image"))

    def cycle(self, engines: Engines = None, *, all_engines: bool = False,
              drain: DrainMode | str | None = None, drain_timeout: float | None = None,
              on_deadline: Escalation | str | None = None,
              level: ReleaseLevel | int | None = None, tags: Iterable[str] | None = None,
              budget: int | str | None = None, deadline: float | None = None,
              max_unavailable: int | str | None = None, op_id: str | None = None,
              timeout_s: float | None = None) -> p.OperationResult:
        """Prepare, capture and restore ``engines``, rolling across them with at most
        ``max_unavailable`` out of service at once: a number, or a percentage such as
        ``"50%"`` (default: the controller's, 25% of them, at least one; ``"100%"``: all at
        once). The prepare keywords are ``prepare``'s."""
        if isinstance(max_unavailable, str) and not max_unavailable.strip().endswith("%"):
            # a number is given as a number, as everywhere in this client; text is a percentage
            raise UsageError(f"max_unavailable = {shown(max_unavailable)} is not a valid "
                             f"limit: give an int of engines or a percentage such as '25%'",
                             field="max_unavailable", value=shown(max_unavailable))
        limit = check_optional(MAX_UNAVAILABLE, max_unavailable, "max_unavailable")
        counted = {} if limit is None else {
            "max_unavailable_percent" if limit.percent else "max_unavailable": limit.value}
        return self._operation(OperationKind.CYCLE, engines, all_engines, op_id, timeout_s,
                               deadline, **counted,
                               **self._prepare_params(drain, drain_timeout, on_deadline, level,
                                                      tags, budget))

    def rollback(self, engines: Engines = None, *, all_engines: bool = False,
                 reason: str = "", deadline: float | None = None, op_id: str | None = None,
                 timeout_s: float | None = None) -> p.OperationResult:
        """Return PREPARED ``engines`` to RUNNING; ``reason`` is recorded with the
        transition."""
        if not isinstance(reason, str) or len(reason) > MAX_TEXT_LENGTH:
            raise UsageError(f"reason = {shown(reason)} is not a text of at most "
                             f"{MAX_TEXT_LENGTH} characters", field="reason",
                             value=shown(reason))
        return self._operation(OperationKind.ROLLBACK, engines, all_engines, op_id, timeout_s,
                               deadline, reason=reason)

    def operation(self, kind: OperationKind | str, engines: Engines = None, *,
                  all_engines: bool = False, op_id: str | None = None,
                  timeout_s: float | None = None, **fields) -> p.OperationResult:
        """Any operation with ``OperationCommand``'s own field names (``deadline_s``,
        ``drain_timeout_s``, ``residual_budget_bytes``...): the wire's spelling, for code
        that builds commands itself. Its limits are checked before sending as well."""
        kind = _word(OperationKind, kind, "kind")
        op_id = new_op_id() if op_id is None else check(OP_ID, op_id, "op_id")
        cmd = p.OperationCommand(call_id=0, op_id=op_id, kind=kind,
                                 engines=_chosen(engines, all_engines), **fields)
        return self.call(p.RequestType.OPERATION, cmd,
                         timeout_s=DEFAULT_OPERATION_TIMEOUT_S if timeout_s is None else timeout_s)

    # ------------------------------------------------------------ parameters

    @staticmethod
    def _prepare_params(drain, drain_timeout, on_deadline, level, tags, budget) -> dict:
        level = _word(ReleaseLevel, level, "level")
        return {"drain": _word(DrainMode, drain, "drain"),
                "drain_timeout_s": check_optional(DURATION, drain_timeout, "drain_timeout"),
                "on_deadline": _word(Escalation, on_deadline, "on_deadline"),
                "level": level, "tags": _tags(tags, level),
                "residual_budget_bytes": check_optional(BYTES, budget, "budget")}

    def _operation(self, kind: OperationKind, engines: Engines, all_engines: bool,
                   op_id: str | None, timeout_s: float | None, deadline: float | None,
                   **fields) -> p.OperationResult:
        """Every value checked (the deadline here, names and op id by ``operation``), then
        sent. After ``subscribe()`` the controller's heartbeats bound the wait (a controller
        that dies is noticed within seconds); else ``timeout_s`` does (default
        ``DEFAULT_OPERATION_TIMEOUT_S``)."""
        fields["deadline_s"] = check_optional(DURATION, deadline, "deadline")
        if timeout_s is not None:
            timeout_s = check(DURATION, timeout_s, "timeout_s")
        return self.operation(kind, engines, all_engines=all_engines, op_id=op_id,
                              timeout_s=timeout_s, **fields)
