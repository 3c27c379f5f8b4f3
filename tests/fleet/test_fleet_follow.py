"""Following a fleet operation while etcd falters: the command waits for etcd (saying so)
instead of giving up at the first slow read, and gives up, typed, only after its patience."""

from __future__ import annotations

import msgspec
import pytest

from ckpt_controller.fleet import ops
from ckpt_controller.fleet.records import FleetOp
from support.processes import sigstop
from support.timing import deadline_in, scaled


@pytest.mark.fleet
def test_following_outlasts_an_etcd_that_stops_answering_for_a_while(etcd, capsys):
    """A followed operation goes on without the command; etcd stopped (SIGSTOP) for longer
    than a read's timeout costs the command a pause it says, not an exit 4 (the vLLM
    migration test once ended this way under load), and it reports the end once etcd is
    back. Past ``patience_s`` of silence it gives up with the etcd error."""
    import signal
    import threading
    import time

    from ckpt_controller.cli import fleet_follow
    from ckpt_controller.errors import UnreachableError
    from ckpt_controller.fleet.keys import Keys
    from ckpt_controller.fleet.records import Part, encode

    keys = Keys("/ckpt-test")
    op = FleetOp(op_id="op-9", kind="cycle", engines=["e0"], params={}, max_unavailable=1,
                 created=time.time())
    part = Part(engine="e0", node="n0", local_op="op-9.e0", status="started")
    with etcd.client(timeout_s=0.5) as c:
        c.put(keys.part("op-9", "e0"), encode(part))
        c.put(keys.op("op-9"), encode(op))
        box: list = []
        t = threading.Thread(target=lambda: box.append(
            fleet_follow.follow(c, keys, "op-9", progress=True, every_s=0.05)), daemon=True)
        proc = etcd.procs[0]
        sigstop(proc.pid)
        try:
            t.start()
            deadline = deadline_in(30)
            while "etcd did not answer" not in capsys.readouterr().err:
                assert time.monotonic() < deadline, "the command never said etcd was silent"
                time.sleep(0.05)
            time.sleep(1.5)  # several reads go unanswered: 0.5 s each
            assert t.is_alive(), box
        finally:
            proc.send_signal(signal.SIGCONT)
        with etcd.client() as w:
            w.put(keys.part("op-9", "e0"), encode(msgspec.structs.replace(
                part, status="succeeded", state="running", ended=time.time())))
            w.put(keys.op("op-9"), encode(msgspec.structs.replace(
                op, status="succeeded", ended=time.time())))
        t.join(scaled(30))
        assert not t.is_alive()
        ended, parts = box[0]
        assert ended.status == "succeeded" and parts[0].status == "succeeded"
        assert "etcd answers again" in capsys.readouterr().err

        # past its patience the command gives up, with etcd's error
        sigstop(proc.pid)
        try:
            patient = fleet_follow.Patient("op-9", patience_s=1.0)
            t0 = time.monotonic()
            with pytest.raises(UnreachableError):
                patient.read(lambda: ops.read_op(c, keys, "op-9"))
            assert 1.0 <= time.monotonic() - t0 < scaled(10)
        finally:
            proc.send_signal(signal.SIGCONT)
