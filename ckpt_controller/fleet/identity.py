"""Who a node is: the identity that owns its name, and what counts as its registration.

A node's name belongs to the controller that first registered it: its node id (32 hex digits,
made at its first start in ``<state_dir>/node-id``, ``node_identity``), written once to
``node-ids/<node>`` in etcd under no lease (``claim_name``). Another controller with the same
name (another state dir) is refused also after the first one's lease expired (it was paused,
or cut off), so it never takes the name nor deletes the first's records; ``ckptctl fleet
forget-node`` frees the name of a node gone for good. ``registration`` tells a controller's
``nodes/<node>`` record (under a lease) from one written by hand.
Neighbours: ``node`` (registers with these), ``keys``, ``records``, ``cli.fleet_cmd``
(``forget-node``).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from ckpt_controller import files
from ckpt_controller.errors import ConfigError, DamagedRecordError
from ckpt_controller.fleet import etcd as e
from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.keys import Keys

NODE_ID_FILE = "node-id"


def node_identity(state_dir: Path) -> str:
    """This controller's node identity: ``<state_dir>/node-id``, made (random, 32 hex
    digits) the first time; it survives restarts and pauses, and goes only with the state
    dir. Made whole or not at all (written to a temporary name, then linked into place), so
    a controller killed while making it leaves no empty file. ``ConfigError`` naming the
    file when it holds anything else."""
    path = state_dir / NODE_ID_FILE
    if not os.path.lexists(path):
        tmp = state_dir / f".{NODE_ID_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never over one already there
        except FileExistsError:  # policy: made meanwhile: that one is read below
            pass
        finally:
            tmp.unlink(missing_ok=True)
    try:
        text = files.read_small(path, 256).decode("ascii", "replace").strip()
    except (OSError, files.UnfitFileError):  # policy: said as a damaged identity
        text = ""
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        raise ConfigError(f"{path} is not a node identity (32 hex digits): the fleet knows "
                          "this node by it; restore it, or remove it and free the node's "
                          "name with `ckptctl fleet forget-node`", path=str(path))
    return text


def claim_name(client: e.Etcd, keys: Keys, node: str, node_id: str) -> str | None:
    """``node-ids/<node>`` names ``node_id`` (written now if absent): None; else the
    identity it names (another controller's)."""
    key = keys.node_id(node)
    ok, resp = client.txn([e.compare_created(key)], [e.put_op(key, node_id)], [e.get_op(key)])
    if ok or not resp[0]["kvs"]:
        return None
    held = resp[0]["kvs"][0].value.decode(errors="replace")
    return None if held == node_id else held


def registration(kv) -> bool:
    """Whether ``kv`` (a ``nodes/<node>`` key) is some controller's registration: under a
    lease, and a node record."""
    if kv.lease == 0:
        return False
    try:
        r.decode(r.NodeRecord, kv.value, kv.key)
    except DamagedRecordError:  # policy: unreadable: no controller wrote it
        return False
    return True
