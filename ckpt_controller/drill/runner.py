"""``ckptctl drill``: N checkpoint cycles under load, with faults, checked and reported.

The drill starts what it drills (a controller and one reference engine per name, real
processes, their logs and journal under ``REPORT/work``), then for every cycle: arms the
cycle's fault, sends load to every engine, runs ``cycle`` through the controller half way
into the load, checks the fault's documented outcome and handles its aftermath (an engine
started again, a FAILED engine recovered, the controller restarted, the reconciler awaited),
waits for every request to end, replays the completed ones on the engine to compare outputs
token for token, and measures each engine's RSS. ``report.json`` and ``timeline.png`` are
written at the end. Neighbours: ``faults`` (what and what must follow), ``report`` (the
verdict), ``timeline`` (the picture), ``agent.failpoints``, ``engine.load``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import psutil

from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.hooks import install_criu_dump_hook
from ckpt_controller.criu_images import image_bytes
from ckpt_controller.drill.faults import RUNS_WITH, Fault
from ckpt_controller.endpoints import free_port
from ckpt_controller.engine.load import LoadControl, LoadReport, replay, run_load
from ckpt_controller.errors import CkptError, OperationError, UnreachableError, UsageError
from ckpt_controller.procutil import ReadyProcess
from ckpt_controller.vocab import (
    TRANSITIONAL,
    CheckpointState,
    DrainMode,
    FinishReason,
    HookPoint,
    OperationKind,
    OperationStatus,
    ReleaseLevel,
)

MiB = 1 << 20
#: the residual fault's ballast, and how far above the engine's RSS its budget sits
BALLAST_BYTES = 256 * MiB
BUDGET_MARGIN_BYTES = 64 * MiB
HEARTBEAT_S, MISSED_BEATS = 0.5, 6
#: how long a stalled agent stays silent: well past the controller's liveness limit
STALL_S = HEARTBEAT_S * MISSED_BEATS + 4
HOOK_TIMEOUT_S = 3.0


@dataclass
class DrillOptions:
    engines: list[str]
    cycles: int
    report_dir: Path
    rate: float = 10.0
    drain: DrainMode = DrainMode.KEEP
    level: ReleaseLevel = ReleaseLevel.DISCARD
    faults: list[Fault] = field(default_factory=list)
    #: seconds of load per cycle; the cycle starts half way
    load_s: float = 3.0
    model: str = "tiny"
    capture: bool = False
    seed: int = 0


class _Engine:
    """One reference engine the drill runs, started again after a fault killed it."""

    def __init__(self, drill: Drill, name: str) -> None:
        self.name = name
        self.drill = drill
        self.api = f"tcp://127.0.0.1:{free_port()}"
        self.control = f"tcp://127.0.0.1:{free_port()}"
        self.proc: ReadyProcess | None = None
        self.incarnation = 0

    def start(self, failpoints: str = "") -> None:
        self.stop()
        env = dict(self.drill.env)
        if failpoints:
            env["CKPT_FAILPOINTS"] = failpoints
        work = self.drill.work
        self.proc = ReadyProcess(
            self.drill.py + ["engine", "serve", "--name", self.name, "--api", self.api,
                             "--control", self.control, "--model", self.drill.opts.model,
                             "--model-dir", str(work / "models")],
            work / f"engine-{self.name}.log", f"engine {self.name}", env=env)
        self.incarnation += 1

    def alive(self) -> bool:
        return self.proc is not None and _alive(self.proc.pid)

    def rss(self) -> int | None:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except (psutil.Error, AttributeError):  # policy: a dead engine has no RSS
            return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class Drill:
    def __init__(self, opts: DrillOptions, say: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.say = say
        self.work = opts.report_dir / "work"
        self.py = [sys.executable, "-m", "ckpt_controller"]
        self.env = {k: v for k, v in os.environ.items() if k != "CKPT_FAILPOINTS"}
        self.engines = [_Engine(self, name) for name in opts.engines]
        self.controller: ReadyProcess | None = None
        self._sockets = Path(tempfile.mkdtemp(prefix="ckpt-drill-"))  # short ipc paths
        self.endpoint = f"ipc://{self._sockets}/controller"
        self.started_wall = time.time()

    # ------------------------------------------------------------------ processes

    def _write_config(self) -> Path:
        w = self.work
        hooks = w / "hooks"
        hooks.mkdir(parents=True, exist_ok=True, mode=0o700)
        engines = "".join(f'\n[[engine]]\nname = "{e.name}"\ncontrol = "{e.control}"\n'
                          for e in self.engines)
        path = w / "controller.toml"
        path.write_text(
            f'[controller]\nendpoint = "{self.endpoint}"\nstate_dir = "{w / "state"}"\n'
            f'hooks_dir = "{hooks}"\nimage_dir = "{w / "images"}"\n'
            f"heartbeat_interval_s = {HEARTBEAT_S}\nmissed_beats = {MISSED_BEATS}\n"
            f"reconcile_interval_s = 1\n\n"
            f"[deadlines]\ndrain = 10\nhook = {HOOK_TIMEOUT_S}\n\n"
            f'[defaults]\ndrain = "{self.opts.drain}"\nlevel = {self.opts.level}\n'
            f'on_deadline = "keep"\n' + engines)
        return path

    def start_controller(self) -> None:
        if self.controller is not None:
            self.controller.stop()
        self.controller = ReadyProcess(self.py + ["serve", "--config", str(self.config)],
                                       self.work / "controller.log", "the controller",
                                       env=self.env)

    def setup(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.config = self._write_config()
        if self.opts.capture:
            _install_dump_hook(self.work / "hooks")
        for e in self.engines:
            e.start()
        self.start_controller()

    def teardown(self) -> None:
        if self.controller is not None:
            self.controller.stop()
        for e in self.engines:
            e.stop()
        shutil.rmtree(self._sockets, ignore_errors=True)

    # ------------------------------------------------------------------ the drill

    def run(self) -> list[dict]:
        """Every cycle's record (see ``report``)."""
        by_cycle = {f.cycle: f for f in self.opts.faults}
        self.setup()
        try:
            return [self._cycle(n, by_cycle.get(n)) for n in range(1, self.opts.cycles + 1)]
        finally:
            self.teardown()

    def _cycle(self, n: int, fault: Fault | None) -> dict:
        opts = self.opts
        target = self.engines[0]
        cleanup = self._arm(fault, target)
        rss_before = {e.name: e.rss() for e in self.engines}
        # every engine of a cycle at once (``100%``), as a drill always cycled them: a fault
        # on one is seen beside the others' cycles, not instead of them (a rolling cycle
        # would skip the rest at the first failure)
        params: dict = {"drain": opts.drain, "level": opts.level, "max_unavailable_percent": 100}
        if fault is not None and fault.kind == "residual":
            params["residual_budget_bytes"] = (rss_before[target.name] or 0) + BUDGET_MARGIN_BYTES
        loads = {e.name: _Load(e.api, opts.rate, opts.load_s, opts.seed * 1000 + n)
                 for e in self.engines}
        for load in loads.values():
            load.start()
        time.sleep(opts.load_s / 2)
        op_id = f"drill-{int(self.started_wall)}-{n}"
        watcher = _ControllerKiller(self, target, fault.where) \
            if fault is not None and fault.kind == "kill-controller" else None
        try:
            result = self._operation(op_id, params)
        finally:
            if watcher is not None:
                watcher.done.set()
                watcher.join()
        record: dict = {"cycle": n, "fault": str(fault) if fault else None,
                        "fault_engine": target.name if fault else None, "op_id": op_id,
                        "status": result.status, "duration_s": result.duration_s,
                        "wall": result.wall, "problems": [], "after": []}
        problems = record["problems"]
        if fault is not None:
            record["expected"] = fault.expected.text
            self._check_fault(fault, target, result, record, loads[target.name])
        cleanup()
        self._settle_all(record)
        for e in self.engines:
            states = self._states()
            if states.get(e.name) != CheckpointState.RUNNING:
                problems.append(f"{e.name} is {states.get(e.name)} at the end of the cycle")
        record["engines"] = [self._engine_record(e, result, loads[e.name], op_id)
                             for e in self.engines]
        for er in record["engines"]:
            req = er["requests"]
            if req["lost"]:
                problems.append(f"{er['engine']}: {req['lost']} requests lost")
            if er["verification"]["mismatched"]:
                problems.append(f"{er['engine']}: {len(er['verification']['mismatched'])} "
                                f"outputs differ from an uninterrupted run")
        if fault is None and result.status != OperationStatus.SUCCEEDED:
            problems.append(f"cycle {result.status}: "
                            f"{result.error.message if result.error else 'no error given'}")
        record["ok"] = not problems
        self._say_cycle(record)
        return record

    # ------------------------------------------------------------------ faults

    def _arm(self, fault: Fault | None, target: _Engine) -> Callable[[], None]:
        """Put the fault in place; returns what takes it away again."""
        hooks = self.work / "hooks"
        placed: list[Path] = []

        def hook(point: str, body: str) -> None:
            path = hooks / point / "50-drill-fault"
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_text(f"#!/bin/sh\n{body}\n")
            path.chmod(0o700)
            placed.append(path)

        if fault is None:
            pass
        elif fault.kind in ("fail-hook", "hang-hook"):
            body = ("echo 'drill: injected hook failure' >&2\nexit 7" if fault.kind == "fail-hook"
                    else "exec sleep 3600")
            hook(fault.where, body)
            if fault.where in RUNS_WITH:  # on-fail runs only after a failure
                hook(RUNS_WITH[fault.where], "echo 'drill: injected failure' >&2\nexit 7")
        elif fault.kind == "kill-controller":
            # a hook that holds the controller in the phase, so the kill lands inside it
            hook({CheckpointState.PREPARING: HookPoint.POST_DRAIN,
                  CheckpointState.PREPARED: HookPoint.DUMP,
                  CheckpointState.RESTORING: HookPoint.POST_RESTORE}[fault.where], "sleep 2")
        elif fault.kind == "kill-engine" and fault.where == OperationKind.CAPTURE:
            hook(HookPoint.DUMP, 'kill -9 "$CKPT_ENGINE_PID"; sleep 1; exit 1')
        elif fault.kind == "kill-engine":
            target.start(f"{fault.where}:kill")
        elif fault.kind == "stall-agent":
            target.start(f"{fault.where}:stall={STALL_S:g}")
        elif fault.kind == "corrupt-weight":
            target.start("rewake:corrupt")
        elif fault.kind == "residual":
            target.start(f"release:ballast={BALLAST_BYTES}")
        return lambda: [path.unlink(missing_ok=True) for path in placed]

    def _check_fault(self, fault: Fault, target: _Engine, result: p.OperationResult,
                     record: dict, load: _Load) -> None:
        exp = fault.expected
        problems, after = record["problems"], record["after"]
        outcome = next((o for o in result.engines if o.engine == target.name), None)
        if result.status not in exp.status:
            problems.append(f"{fault}: operation {result.status}, expected "
                            f"{' or '.join(exp.status)}")
        if exp.state == "gone":
            time.sleep(0.2)
            seen = "gone" if not target.alive() else self._states().get(target.name)
        elif exp.state == "unknown":
            seen = "unknown"
        else:
            seen = outcome.state if outcome is not None else None
        record["seen_state"] = seen
        if seen != exp.state:
            problems.append(f"{fault}: engine {seen} after the operation, expected {exp.state}")
        got_error = outcome.error.kind if outcome is not None and outcome.error else None
        record["error"] = (outcome.error.message if outcome is not None and outcome.error
                           else None)
        if exp.error is not None and got_error != exp.error:
            problems.append(f"{fault}: error {got_error}, expected {exp.error}")
        # the aftermath; what took time in it goes on the timeline (``record["aftermath"]``)
        spans = record.setdefault("aftermath", [])
        began = time.time()
        if exp.after == "replace" or (exp.state == "gone" and not target.alive()):
            if target.alive():
                target.stop()
            load.control.engine_lost("the engine process died (drill fault)")
            target.start()
            after.append("engine started again")
            spans.append({"kind": "restart", "engine": target.name, "wall": began,
                          "duration_s": time.time() - began})
        elif exp.after == "reconcile":
            settled = self._wait_reconciled(target.name, timeout_s=STALL_S + 30)
            spans.append({"kind": "reconcile", "engine": target.name, "wall": began,
                          "duration_s": time.time() - began})
            if settled:
                after.append("reconciled by the controller")
            else:
                problems.append(f"{fault}: the controller did not reconcile {target.name}")
        elif exp.after == "recover":
            for path in (self.work / "hooks").glob("*/50-drill-fault"):
                path.unlink()
            # only the FAILED engines: a restore sent to a RUNNING one is refused, and would
            # fail a recovery that worked
            failed = [name for name, state in self._states().items()
                      if state == CheckpointState.FAILED]
            if not failed:  # an empty list would name every engine
                problems.append(f"{fault}: no engine is FAILED to recover")
            else:
                again = self._operation(record["op_id"] + "-recover", {},
                                        kind=OperationKind.RESTORE, engines=failed)
                after.append(f"restore (recovery from FAILED): {again.status}")
                spans += [{"kind": "recovery", "engine": name, "wall": again.wall,
                           "duration_s": again.duration_s} for name in failed]
                if again.status != OperationStatus.SUCCEEDED:
                    problems.append(f"{fault}: recovery from FAILED {again.status}")
        elif exp.after == "restart-controller":
            after.append("controller restarted and reconciled")

    def _wait_reconciled(self, engine: str, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                with ControllerClient(self.endpoint, timeout_s=10, retries=0) as c:
                    (view,) = c.status([engine]).engines
                if view.unsettled_by is None and view.status is not None \
                        and view.status.state == CheckpointState.RUNNING:
                    return True
            except CkptError:  # policy: keep asking until the deadline
                pass
            time.sleep(0.5)
        return False

    # ------------------------------------------------------------------ controller calls

    def _operation(self, op_id: str, params: dict, kind: str = OperationKind.CYCLE,
                   engines: list[str] | None = None) -> p.OperationResult:
        """Run the operation on ``engines`` (default: all); if the controller died under it,
        start it again (it reconciles) and ask for the same operation id: the journal's
        result comes back."""
        names = engines if engines is not None else [e.name for e in self.engines]
        for _attempt in range(3):
            try:
                with ControllerClient(self.endpoint, timeout_s=10, retries=0) as c:
                    c.subscribe()
                    return c.operation(kind, names, op_id=op_id, **params)
            except UnreachableError:
                if self.controller is not None and _alive(self.controller.pid):
                    raise
                self.start_controller()
        raise OperationError("the controller kept dying", op_id=op_id)

    def _states(self) -> dict[str, str | None]:
        with ControllerClient(self.endpoint, timeout_s=10, retries=1) as c:
            views = c.status().engines
        return {v.engine: v.status.state if v.status else None for v in views}

    def _settle_all(self, record: dict) -> None:
        """No engine may stay in a transitional state, held, or unsettled (the reconciler
        still to look at it): wait a little for one that is."""
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with ControllerClient(self.endpoint, timeout_s=10, retries=1) as c:
                views = c.status().engines
            busy = [v.engine for v in views if v.holder or v.unsettled_by or v.status is None
                    or v.status.state in TRANSITIONAL]
            if not busy:
                return
            time.sleep(0.2)
        record["problems"].append(f"engines not settled: {busy}")

    # ------------------------------------------------------------------ per engine

    def _engine_record(self, e: _Engine, result: p.OperationResult, load: _Load,
                       op_id: str) -> dict:
        report, requests = load.join()
        completed = {rid: c.token_ids for rid, c in requests.items()
                     if c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)}
        mismatched: list[str] = []
        if completed:
            again = replay(e.api, load.seed, list(completed))
            mismatched = sorted(rid for rid, tokens in completed.items() if again[rid] != tokens)
        o = next((o for o in result.engines if o.engine == e.name), None)
        image = self.work / "images" / e.name / op_id
        image_size = image_bytes(image) if image.exists() else None
        shutil.rmtree(self.work / "images" / e.name, ignore_errors=True)
        return {
            "engine": e.name, "incarnation": e.incarnation, "state": o.state if o else None,
            "status": o.status if o else None,
            "phases": [msgspec.to_builtins(ph) for ph in o.phases] if o else [],
            "drain": msgspec.to_builtins(o.drain) if o and o.drain else None,
            "memory": {
                "freed_bytes": o.released.freed_bytes if o and o.released else None,
                "residual_bytes": o.released.residual_bytes if o and o.released else None,
                "rewoken_bytes": o.rewoken.tensor_bytes if o and o.rewoken else None,
                "verified_tensors": o.rewoken.verified_tensors if o and o.rewoken else None,
            },
            "image_bytes": image_size,
            "verification": {"compared": len(completed), "mismatched": mismatched},
            "requests": {
                "sent": report.sent, "completed": report.completed, "aborted": report.aborted,
                "kept": o.drain.kept if o and o.drain else 0, "rejected": report.rejected,
                "shed": report.shed, "errored": report.errored,
                "ended_by_engine_death": len(load.control.ended_by_loss),
                "lost": report.lost, "lost_ids": report.lost_ids,
            },
            "rss_bytes": e.rss(),
        }

    def _say_cycle(self, r: dict) -> None:
        sent = sum(e["requests"]["sent"] for e in r["engines"])
        done = sum(e["requests"]["completed"] for e in r["engines"])
        lost = sum(e["requests"]["lost"] for e in r["engines"])
        fault = f"  fault {r['fault']}" if r["fault"] else ""
        verdict = "ok" if r["ok"] else "PROBLEM: " + "; ".join(r["problems"])
        self.say(f"cycle {r['cycle']:>3}: {r['status']:<11} {r['duration_s'] * 1000:7.0f} ms  "
                 f"requests {sent} sent, {done} completed, {lost} lost{fault}  {verdict}")


class _Load:
    """``run_load`` on a thread for one engine."""

    def __init__(self, api: str, rate: float, duration_s: float, seed: int) -> None:
        self.seed = seed
        self.control = LoadControl()
        self._box: dict = {}
        self._thread = threading.Thread(target=self._run, args=(api, rate, duration_s),
                                        daemon=True, name="drill-load")

    def _run(self, api: str, rate: float, duration_s: float) -> None:
        self._box["out"] = run_load(api, rate=rate, duration_s=duration_s, seed=self.seed,
                                    settle_s=120, control=self.control)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> tuple[LoadReport, dict]:
        self._thread.join()
        return self._box["out"]


class _ControllerKiller(threading.Thread):
    """Kills the controller (SIGKILL) as soon as the engine enters ``state``."""

    def __init__(self, drill: Drill, engine: _Engine, state: str) -> None:
        super().__init__(daemon=True, name="drill-kill-controller")
        self.drill, self.engine, self.state = drill, engine, state
        self.done = threading.Event()
        self.client = AgentClient(engine.control, timeout_s=5)
        self.client.subscribe()  # before the operation starts: no transition is missed
        self.start()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                for ev in self.client.poll_events(0.05):
                    if isinstance(ev, p.StateChanged) and ev.transition.dest == self.state:
                        self.drill.controller.kill9()
                        return
        finally:
            self.client.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # policy: no such process
        return False


def _install_dump_hook(hooks_dir: Path) -> None:
    said = install_criu_dump_hook(hooks_dir)
    if said != "installed":
        raise UsageError(f"--capture needs CRIU: {said}")
