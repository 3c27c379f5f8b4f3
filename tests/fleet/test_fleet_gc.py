"""The fleet's retention (``fleet.gc``, ``ckptctl fleet gc``) against a real etcd (``make
etcd``): ended operations older than the bound go with every key of their own; what
something still names stays, and so does what is recent, running or unreadable."""

from __future__ import annotations

import json
import time

from ckpt_controller.fleet import records as r
from ckpt_controller.fleet.keys import Keys
from support.cli import ckptctl

K = Keys("/ckpt")
DAY = 86400.0


def _op(op_id: str, kind: str, ended_days_ago: float | None, engines=("a",)) -> bytes:
    now = time.time()
    ended = None if ended_days_ago is None else now - ended_days_ago * DAY
    return r.encode(r.FleetOp(op_id=op_id, kind=kind, engines=list(engines), max_unavailable=1,
                              created=now - 30 * DAY,
                              status="running" if ended is None else "succeeded", ended=ended))


def test_fleet_gc_forgets_old_operations_and_keeps_what_is_still_named(etcd):
    from ckpt_controller.fleet.etcd import Etcd

    with Etcd(etcd.urls) as c:
        c.put(K.op("old-cycle"), _op("old-cycle", "cycle", 10, ("a", "b")))
        for engine in ("a", "b"):
            c.put(K.part("old-cycle", engine), r.encode(r.Part(engine=engine, node="n1",
                                                                local_op=f"x.{engine}")))
        c.put(K.op("old-held"), _op("old-held", "prepare", 10))
        c.put(K.unavailable, json.dumps({"a": "old-held"}))
        c.put(K.op("recent"), _op("recent", "cycle", 1))
        c.put(K.op("running"), _op("running", "cycle", None))
        for op_id in ("old-mig-1", "old-mig-2"):  # m's two migrations; the second is newest
            c.put(K.op(op_id), _op(op_id, "migrate", 10, ("m",)))
            c.put(K.migration(op_id), r.encode(r.Migration(
                op_id=op_id, engine="m", source="n1", target="n2", outcome="moved")))
            c.put(K.step_end(op_id, "receive"), b"{}")
            c.put(K.images(op_id) + "0", b"x")
        c.put(K.op("damaged"), b"{not json")
        out = ckptctl("--etcd", ",".join(etcd.urls), "fleet", "gc", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        doc = json.loads(out.stdout)
        assert sorted(doc["deleted"]) == ["old-cycle", "old-mig-1"]
        assert doc["kept"] == {"old-held": "a is out of service by it",
                               "old-mig-2": "the newest migration of m"}
        assert list(doc["unreadable"]) == [K.op("damaged")]
        left = {kv.key for kv in c.get_prefix("/ckpt/")}
        assert not any("old-cycle" in key or "old-mig-1" in key for key in left)
        for key in (K.op("old-held"), K.op("recent"), K.op("running"), K.op("damaged"),
                    K.migration("old-mig-2"), K.step_end("old-mig-2", "receive")):
            assert key in left
        human = ckptctl("--etcd", ",".join(etcd.urls), "fleet", "gc", "--keep-days", "0.5")
        assert human.returncode == 0, human.stderr
        assert "forgot 1 operations ended over 0.5 days ago" in human.stdout  # "recent"
        assert "kept old-held: a is out of service by it" in human.stdout
