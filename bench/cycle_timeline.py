"""Where one engine's cycle spends its wall time: the controller's own steps, stamped.

One engine (a real ``Agent`` with nothing registered, in a process of its own), a real
``ControllerServer`` in this process (so that its steps can be stamped) and a
``ControllerClient`` driving it, subscribed as ``ckptctl cycle`` is. Each of ``--repeat``
cycles stamps, as offsets from the client's request: the control thread taking the request,
the operation's thread starting, the journal's ``begin`` returning (its fsync), each call to
the agent leaving and its answer handled, the journal's ``finish`` (its fsync), the reply
queued for the control thread and sent by it, and the client holding the result. The
journal is on disk (a temp dir, or ``--state-dir``), then in ``/dev/shm``. Each stamp wraps a
method and costs a few microseconds itself; ``bench/control.py`` measures the cycle unstamped.

The table gives each step's median offset and the median of the segment up to it, in
microseconds and in bare round trips (RT: a pyzmq DEALER to a ROUTER echo in another process,
over ipc, as ``control.py`` measures it).
Neighbours: ``control`` (the cycle unstamped, the goals), ``_hosts`` (the processes).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from _common import median, parser, table, write
from _hosts import EchoHost, Fleet
from control import MEMORY_DIR, config

#: the stamps, in the order a cycle passes them: (key, what)
STEPS = [("request", "the control thread has the request"),
         ("op_thread", "the operation's thread starts"),
         ("begun", "the journal's begin returned (fsynced)"),
         ("call1_sent", "the prepare call to the agent begins"),
         ("call1_back", "its answer is handled"),
         ("call2_sent", "the restore call begins"),
         ("call2_back", "its answer is handled"),
         ("finishing", "the journal's finish begins"),
         ("finished", "it returned (fsynced)"),
         ("reply_queued", "the reply is queued for the control thread"),
         ("reply_sent", "the control thread sends it"),
         ("client", "the client has the result")]


class Stamps:
    """Wraps the controller's methods to note when each step is reached in this cycle."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.calls = 0
        self._undo: list[tuple[object, str, object]] = []

    def note(self, key: str) -> None:
        self.now.setdefault(key, time.perf_counter())

    def wrap(self, owner, name: str, before=None, after=None) -> None:
        """``before``/``after``: a step's key, or a function of the call's arguments giving
        one (or None: no step)."""
        orig = getattr(owner, name)

        def stamped(*args, **kwargs):
            key = before(*args) if callable(before) else before
            if key:
                self.note(key)
            try:
                return orig(*args, **kwargs)
            finally:
                key = after(*args) if callable(after) else after
                if key:
                    self.note(key)

        self._undo.append((owner, name, orig))
        setattr(owner, name, stamped)

    def install(self) -> None:
        from ckpt_controller import protocol as p
        from ckpt_controller import zmqutil
        from ckpt_controller.controller import journal, links, server, service
        from ckpt_controller.rpcserver import RpcServer

        operations = (p.RequestType.PREPARE, p.RequestType.RESTORE)

        def call_sent(_link, rtype, *_args) -> str | None:  # a status asked is not stamped
            if rtype not in operations:
                return None
            self.calls += 1
            return f"call{self.calls}_sent"

        def call_back(_link, rtype, *_args) -> str | None:
            return f"call{self.calls}_back" if rtype in operations else None

        reply = p.ReplyType.REPLY.value

        def reply_sent(_outbox, frames) -> str | None:  # [identity, type, body]: not an event
            return "reply_sent" if frames[1] == reply else None

        self.wrap(server.ControllerServer, "handle", before="request")
        self.wrap(service.Controller, "_run", before="op_thread")
        self.wrap(journal.Journal, "begin", after="begun")
        self.wrap(links.AgentLink, "call", before=call_sent, after=call_back)
        self.wrap(journal.Journal, "finish", before="finishing", after="finished")
        self.wrap(RpcServer, "reply", before="reply_queued")
        self.wrap(zmqutil.Outbox, "_deliver", before=reply_sent)

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()


def run(d: Path, state: Path, repeat: int) -> dict:
    """``repeat`` stamped cycles of one engine, the journal in ``state``."""
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.controller.config import parse_config
    from ckpt_controller.controller.server import ControllerServer
    from ckpt_controller.vocab import OperationStatus

    d.mkdir()
    fleet = Fleet(d, 1, 1)
    stamps = Stamps()
    offsets: dict[str, list[float]] = {k: [] for k, _ in STEPS}
    with contextlib.closing(fleet):
        server = ControllerServer(parse_config(config(d, 1, state / f"state-{d.name}"))).start()
        try:
            with ControllerClient(server.endpoint, timeout_s=120) as c:
                c.subscribe()
                c.cycle(["a0"], max_unavailable=1)  # warm: connections, imports
                stamps.install()
                try:
                    for _ in range(repeat):
                        stamps.now.clear()
                        stamps.calls = 0
                        t0 = time.perf_counter()
                        r = c.cycle(["a0"], max_unavailable=1)
                        stamps.note("client")
                        assert r.status == OperationStatus.SUCCEEDED, r.error
                        missing = [k for k, _ in STEPS if k not in stamps.now]
                        assert not missing, f"steps not seen: {missing}"
                        for k, _ in STEPS:
                            offsets[k].append(stamps.now[k] - t0)
                finally:
                    stamps.uninstall()
        finally:
            server.close()
    return {"cycles": repeat, "median_offset_s": {k: median(v) for k, v in offsets.items()}}


def main() -> int:
    p = parser("cycle_timeline", __doc__)
    p.add_argument("--repeat", type=int, default=500, help="stamped cycles per journal")
    p.add_argument("--round-trips", type=int, default=2000, help="bare round trips (the RT)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="the journal's directory on disk (default: a temp dir)")
    args = p.parse_args()
    if args.repeat < 1 or args.round_trips < 1:
        p.error("--repeat and --round-trips must be at least 1")
    results: dict = {"journals": {}}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        d = Path(tmp)
        echo = EchoHost(f"ipc://{d}/echo.sock", d / "echo.log")
        try:
            rt = median(echo.round_trips(args.round_trips))
        finally:
            echo.close()
        results["round_trip_s"] = rt
        results["journals"]["disk"] = run(d / "disk", args.state_dir or d, args.repeat)
        if MEMORY_DIR.is_dir():
            with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=MEMORY_DIR) as mem:
                results["journals"]["memory"] = run(d / "memory", Path(mem), args.repeat)
    journals = results["journals"]
    rows = []
    for key, what in STEPS:
        row = [what]
        for j in journals.values():
            at = j["median_offset_s"][key]
            i = [k for k, _ in STEPS].index(key)
            seg = at - (j["median_offset_s"][STEPS[i - 1][0]] if i else 0.0)
            row += [at * 1e6, seg * 1e6, seg / rt]
        rows.append(row)
    header = ["step"] + [f"{w} {c}" for w in journals for c in ("at us", "segment us",
                                                               "segment RT")]
    table(f"one engine's cycle, stamped (median of {args.repeat} cycles each; bare RT "
          f"{rt * 1e6:.0f} us; a segment is the median step less the median step before it)",
          header, rows)
    write(args.out, "cycle_timeline", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
