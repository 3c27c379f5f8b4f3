"""A migration's record and what both sides agree on: how one is submitted, where it is read,
how a node writes a step's end, and the node-local operation ids of its steps.

``submit`` checks the request against the fleet (the engine registered, RUNNING, free and
reachable; both nodes up; the target not the source) and writes the operation, its one part
and the migration's record in one transaction. ``write_end`` is the only way a step's end
reaches the coordinator: in the transaction that takes the step out of its node's inbox, so a
step the coordinator gave up (its node was lost) cannot end twice.
Neighbours: ``records`` (``Migration``, ``StepEnd``), ``ops`` (ids, repeated ids), ``driver``
and ``steps`` (the two sides), ``cli.fleet_cmd``.
"""

from __future__ import annotations

import time

from ckpt_controller.errors import BusyError, UnreachableError, UsageError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import ops
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.keys import Keys
from ckpt_controller.fleet.kinds import KindSpec
from ckpt_controller.vocab import CheckpointState, MigrationStep, OperationKind

#: the node-local operations of a migration's steps (their ids: ``<op>.<engine>.<kind>``;
#: ``resume`` is the source's restore when the engine did not move)
LOCAL_STEPS = (OperationKind.PREPARE, OperationKind.CAPTURE, OperationKind.RESTORE,
               MigrationStep.RESUME)

#: what a migration says when its source is down for the last step (``settle`` does it when
#: the source is back), whether before that step started or while it ran
SOURCE_ENDS_IT = ("RUNNING on {mig.target}; {mig.source} is down and ends its stopped copy "
                  "when it is back")
SOURCE_RESUMES_IT = "{mig.error}; {mig.source} is down and resumes the engine when it is back"


def local_ids(op_id: str, engine: str) -> dict[str, str]:
    """The node-local operation ids of a migration's steps, by ``LOCAL_STEPS``."""
    base = ops.local_op_id(op_id, engine)
    return {name: f"{base}.{name}" for name in LOCAL_STEPS}


def read(client: e.Etcd, keys: Keys, op_id: str) -> tuple[r.Migration | None, int]:
    """The migration's record and its revision ((None, 0): absent)."""
    kv = client.get(keys.migration(op_id))
    if kv is None:
        return None, 0
    return r.decode(r.Migration, kv.value, kv.key), kv.mod_revision


def submit(client: e.Etcd, keys: Keys, spec: KindSpec, *, op_id: str, engine: str, to: str,
           params: dict) -> r.FleetOp:
    """Record a migration of ``engine`` to node ``to`` (or find the one with this id): the
    operation, its one part and the migration's record, in one transaction."""
    existing = ops.find(client, keys, op_id, spec.kind, [engine])
    if existing is not None:
        return existing
    record = r.read(client, keys.engine(engine), r.EngineRecord)
    if record is None:
        raise UsageError(f"{engine} is not registered in the fleet", engine=engine)
    source = record.node
    if to == source:
        raise UsageError(f"{engine} is on {to} already", engine=engine, node=to)
    up = ops.live_nodes(client, keys)
    for node, what in ((source, "its node"), (to, "the target")):
        if node not in up:
            raise UnreachableError(f"{what} {node} is not registered in the fleet (down, or "
                                   "no such node)", node=node)
    held = client.get(keys.lock(engine))
    if held is not None:
        raise BusyError(f"{engine} is held by operation {held.value.decode()}",
                        engine=engine, holder=held.value.decode())
    if not record.reachable or record.state is None:
        # its node's last look found the agent silent: a busy or stalled engine as often as
        # a dead one, so retryable (exit 4), unlike an engine that says it is not RUNNING
        raise UnreachableError(f"{source} could not reach {engine} when it last looked; "
                               "nothing was started: try again once `ckptctl fleet status` "
                               "shows it running", engine=engine, node=source)
    if record.state is not CheckpointState.RUNNING:
        raise UsageError(f"{engine} is {record.state} on {source}; only a RUNNING engine "
                         "migrates", engine=engine, state=str(record.state))
    preflight(record, up[source], up[to])
    op = r.FleetOp(op_id=op_id, kind=spec.kind, engines=[engine], params=params,
                   max_unavailable=1, created=time.time())
    part = r.Part(engine=engine, node=source, local_op=ops.local_op_id(op_id, engine))
    mig = r.Migration(op_id=op_id, engine=engine, source=source, target=to, params=params,
                      reload_files=dict(record.reload_files))
    return ops.create(client, keys, op, [e.put_op(keys.migration(op_id), r.encode(mig)),
                                         e.put_op(keys.part(op_id, engine), r.encode(part))])


def preflight(record: r.EngineRecord, here: r.NodeRecord, there: r.NodeRecord) -> None:
    """What a migration of ``record``'s engine from node ``here`` to node ``there`` needs
    that can be known before anything moves, refused up front with a ``UsageError`` (exit
    2) that says what to change, instead of a ``criu restore`` that fails after the whole
    send: the engine the init of a PID namespace of its own (its node says so in the
    engine's record), and the two nodes in network namespaces of their own (their node
    records). What a node does not say (an older version) is not refused."""
    engine, source = record.engine, record.node
    if record.own_pid_namespace is False:
        raise UsageError(
            f"{engine} does not run in a PID namespace of its own on {source}, so a copy "
            "restored on another node could not get its PIDs back: start it as `unshare "
            "--pid --fork setsid ckptctl engine serve ...` (docs/fleet.md, Setting it up); "
            "nothing was started", engine=engine, node=source, pid=record.pid)
    to = there.node
    if here.netns and here.netns == there.netns:
        raise UsageError(
            f"{source} and {to} share one network namespace (host {here.host}): a copy "
            f"restored on {to} could not listen on the engine's ports beside the source's, "
            "nor be told apart from it; give each node a network namespace (or a host) of "
            "its own and its own [fleet] address (docs/fleet.md, Setting it up); nothing was "
            "started", engine=engine, source=source, target=to)


def write_end(client: e.Etcd, keys: Keys, task: r.Task, todo_rev: int,
              end: r.StepEnd) -> bool:
    """The step's end, while its task is still in the inbox (else False: given up)."""
    todo = keys.todo(task.node, task.op_id, task.engine)
    ok, _ = client.txn([e.compare_created(todo, todo_rev)],
                       [e.put_op(keys.step_end(task.op_id, end.step), r.encode(end)),
                        e.delete_op(todo)])
    return ok


def capture_op(op_id: str, engine: str) -> str:
    """The node-local id of the source's capture: also the image folder's name on both
    nodes (``<image_dir>/<engine>/<capture op>``)."""
    return local_ids(op_id, engine)[OperationKind.CAPTURE]
