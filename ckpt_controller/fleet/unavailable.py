"""``unavailable``: the engines out of service fleet-wide, what ``--max-unavailable`` counts.

One key (``{"engine": "what took it out"}``: an operation's id, or ``lost:<op>`` for an engine
whose node died under a part), changed only by compare-and-swap transactions on its revision:
a fleet operation's part that takes its engine out starts in the same transaction that adds
the engine; a node-local prepare or cycle adds its engines too (``guard``); an engine leaves
it once it is RUNNING again. A damaged value cannot be counted, so nothing that needs it goes
on (``DamagedRecordError``, naming the repair).
Neighbours: ``records`` (the value's type), ``etcd``, ``parts`` and ``migration.driver``
(the coordinator's), ``guard`` and ``node`` (a node's).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ckpt_controller.errors import BusyError, DamagedRecordError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.records import LOST_PREFIX, Unavailable, decode
from ckpt_controller.vocab import OperationStatus


def read(client: e.Etcd, keys: Keys) -> tuple[Unavailable, int]:
    """The engines out of service (engine -> what took it out) and the key's revision
    (0: absent)."""
    kv = client.get(keys.unavailable)
    if kv is None:
        return {}, 0
    try:
        return decode(Unavailable, kv.value or b"{}", keys.unavailable), kv.mod_revision
    except DamagedRecordError as err:  # policy: nothing can be counted: nothing starts
        raise DamagedRecordError(
            f"{err.message}: the fleet cannot count the engines out of service, so no fleet "
            "operation starts a part; once none is out of service, repair it: etcdctl put "
            f"{keys.unavailable} '{{}}'", key=keys.unavailable) from None


def ops(keys: Keys, out: Unavailable, revision: int) -> tuple[dict, dict]:
    """The compare that ``unavailable`` is still at ``revision``, and the put of ``out``."""
    compare = (e.compare_modified(keys.unavailable, revision) if revision
               else e.compare_created(keys.unavailable))
    return compare, e.put_op(keys.unavailable, json.dumps(out, sort_keys=True))


def update(client: e.Etcd, keys: Keys, change: Callable[[Unavailable], Unavailable | None],
           tries: int = 20) -> None:
    """Apply ``change`` to ``unavailable`` (None: leave it) with compare-and-swap."""
    for _ in range(tries):
        out, rev = read(client, keys)
        new = change(dict(out))
        if new is None or new == out:
            return
        compare, put = ops(keys, new, rev)
        if client.txn([compare], [put])[0]:
            return
    raise BusyError("unavailable changed under every try", key=keys.unavailable)


def is_lost(by: str) -> bool:
    """Whether ``unavailable``'s ``by`` marks an engine lost with its node."""
    return by.startswith(LOST_PREFIX)


def stale_marks(marks: dict[str, str], read_op) -> dict[str, str]:
    """Of ``marks`` (engine -> what ``unavailable`` says took it out, for engines RUNNING
    and free on this node), those that no longer hold: a part lost with this node, or a
    fleet operation that has ended. A mark no fleet record names is a node-local
    operation's, which its own end takes back (it may have begun since the engine was
    seen free): it stays. ``read_op(op_id)``: the fleet operation, or None. Engine -> the
    mark."""
    stale = {}
    for engine, by in marks.items():
        if is_lost(by):
            stale[engine] = by
            continue
        try:
            op = read_op(by)
        except DamagedRecordError:  # policy: unreadable: the mark stays, said elsewhere
            continue
        if op is not None and op.status != OperationStatus.RUNNING:
            stale[engine] = by
    return stale
