"""``ckptctl demo`` (``make demo``): the main job on embedded defaults, start to finish.

In a temporary directory it starts a reference engine and a controller (real processes, ipc
sockets), drives load, runs one full cycle through the controller (prepare with ``keep`` at
level 2, capture, restore), checks that every request ended and that every completed output
equals an uninterrupted run, prints a timeline of the phases, and stops everything it started.
Exit code 0 only when all of that holds. Nothing but argparse loads until the demo runs.
Neighbours: ``procutil`` (the children), ``controller.client``, ``engine.load``, ``cli.common``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_controller.cli.common import EXIT_CODES, human_bytes, positive
from ckpt_controller.vocab import (
    DrainMode,
    FinishReason,
    HookPoint,
    OperationStatus,
    ReleaseLevel,
)

if TYPE_CHECKING:
    from ckpt_controller.procutil import ReadyProcess


def add_parser(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("demo", help="controller + reference engine + load + one full cycle",
                        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--rate", type=positive, default=20.0, help="requests per second (default 20)")
    sp.add_argument("--duration", type=positive, default=4.0, metavar="S",
                    help="seconds of load (default 4); the cycle runs in the middle")
    sp.add_argument("--keep-dir", action="store_true",
                    help="leave the temporary directory (journal, logs) in place")
    sp.set_defaults(run=run)


def _say(text: str = "") -> None:
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="ckpt-demo-"))
    children: list[ReadyProcess] = []
    try:
        return _demo(args, tmp, children)
    finally:
        for child in reversed(children):
            child.stop()
        if args.keep_dir:
            _say(f"\nkept {tmp} (journal, logs)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _demo(args: argparse.Namespace, tmp: Path, children: list[ReadyProcess]) -> int:
    import threading

    from ckpt_controller.cli.controller_cmds import describe_result
    from ckpt_controller.controller.client import ControllerClient
    from ckpt_controller.controller.hooks import install_criu_dump_hook
    from ckpt_controller.endpoints import free_port
    from ckpt_controller.engine.load import replay, run_load
    from ckpt_controller.procutil import ReadyProcess

    py = [sys.executable, "-m", "ckpt_controller"]
    # the engine listens on TCP loopback so CRIU can checkpoint it with clients connected
    api, control = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ctl = f"ipc://{tmp}/ctl"
    (tmp / "hooks").mkdir(mode=0o700, exist_ok=True)  # the controller refuses a missing one
    criu_hook = install_criu_dump_hook(tmp / "hooks")
    _say("ckpt-controller demo: one reference engine, one controller, load, one full cycle")
    _say(f"  working in {tmp}")
    eng = ReadyProcess(py + ["engine", "serve", "--name", "demo-engine", "--api", api, "--control",
                       control, "--model", "tiny", "--model-dir", str(tmp / "models")],
                 tmp / "engine.log", "the reference engine")
    children.append(eng)
    _say(f"  engine demo-engine (pid {eng.info['pid']}): tiny model, "
         f"{human_bytes(eng.info['weight_bytes'])} weights, "
         f"{human_bytes(eng.info['kv_bytes'])} KV cache")
    (tmp / "controller.toml").write_text(
        f'[controller]\nendpoint = "{ctl}"\nstate_dir = "{tmp / "state"}"\n'
        f'hooks_dir = "{tmp / "hooks"}"\n\n'
        f'[defaults]\ndrain = "{DrainMode.KEEP}"\nlevel = {ReleaseLevel.DISCARD}\n\n'
        f'[[engine]]\nname = "demo-engine"\ncontrol = "{control}"\n')
    ctl_proc = ReadyProcess(py + ["serve", "--config", str(tmp / "controller.toml")],
                      tmp / "controller.log", "the controller")
    children.append(ctl_proc)
    _say(f"  controller (pid {ctl_proc.info['pid']}) on {ctl}")
    _say(f"  load: {args.rate:g} requests/s for {args.duration:g}s; the cycle starts half way\n")

    box: dict = {}
    load = threading.Thread(target=lambda: box.update(zip(("report", "requests"), run_load(
        api, rate=args.rate, duration_s=args.duration, seed=7, settle_s=60))))
    load.start()
    time.sleep(args.duration / 2)
    with ControllerClient(ctl) as client:
        result = client.cycle(["demo-engine"], drain=DrainMode.KEEP, level=ReleaseLevel.DISCARD)
        history = client.history(op_id=result.op_id, limit=200)
    load.join()
    report, requests = box["report"], box["requests"]

    _say(describe_result(result))
    _say("\ntimeline:")
    for offset, what in _timeline(history.records):
        _say(f"  +{offset * 1000:8.1f} ms  {what}")
    dumps = [h for o in result.engines for h in o.hooks if h.point == HookPoint.DUMP]
    if dumps:
        said = (dumps[0].stdout_tail.strip() or dumps[0].stderr_tail.strip()).splitlines()
        _say(f"  capture: {said[-1] if said else f'dump hook exited {dumps[0].exit_code}'}")
    else:
        _say(f"  (capture ran no dump hook: {criu_hook})")

    kept = sum(o.drain.kept for o in result.engines if o.drain is not None)
    completed = {rid: c.token_ids for rid, c in requests.items()
                 if c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)}
    again = replay(api, 7, list(completed))
    mismatched = [rid for rid, tokens in completed.items() if again[rid] != tokens]
    _say(f"\nrequests: sent {report.sent}, completed {report.completed}, aborted "
         f"{report.aborted}, rejected {report.rejected} (while not RUNNING, or {report.shed} "
         f"of them shed by a full engine), lost {report.lost}")
    _say(f"  {kept} requests were kept across the cycle and finished after restore")
    _say(f"  {len(completed) - len(mismatched)} of {len(completed)} completed outputs are "
         f"identical to an uninterrupted run")
    ok = result.status == OperationStatus.SUCCEEDED and report.lost == 0 and not mismatched
    _say("\ndemo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def _timeline(records) -> list[tuple[float, str]]:
    """(seconds since the first record, text) for the records a person wants to see, with
    phases placed at their start."""
    rows = []
    for rec in records:
        d, at = rec.data, rec.monotonic
        if rec.type == "transition":
            what = f"{d['source']} -> {d['dest']}"
        elif rec.type == "phase":
            at -= d["duration_s"]
            what = f"  {d['name']:<12} {d['duration_s'] * 1000:8.1f} ms"
        elif rec.type == "drain":
            what = (f"  drain {d['mode']}: {d['completed']} completed, {d['aborted']} aborted, "
                    f"{d['kept']} kept")
        elif rec.type == "memory":
            what = (f"  {d['action']}: {human_bytes(d['tensor_bytes'])} of tensors, RSS "
                    f"{'freed' if d['freed_bytes'] >= 0 else 'back'} "
                    f"{human_bytes(abs(d['freed_bytes']))}")
        elif rec.type == "hook":
            at -= d["duration_s"]
            what = f"    hook {d['point']}: exit {d['exit_code']} in {d['duration_s'] * 1000:.1f} ms"
        else:
            continue
        rows.append((at, what))
    rows.sort(key=lambda row: row[0])
    start = rows[0][0] if rows else 0.0
    return [(at - start, what) for at, what in rows]
