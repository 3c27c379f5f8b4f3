"""CRIU-style hooks: executables the controller runs at fixed points of an operation.

Layout: ``<hooks_dir>/<point>/<executable>``; several executables at one point run in name
order, and the first failure stops the point. Each gets its context in the environment
(``CKPT_ACTION``, ``CKPT_ENGINE``, ``CKPT_ENGINE_PID``, ``CKPT_STATE``, ``CKPT_GENERATION``,
``CKPT_OP_ID``, ``CKPT_IMAGE_DIR``, ``CKPT_DEADLINE`` (wall-clock seconds), plus
``CRTOOLS_INIT_PID``, ``CRTOOLS_SCRIPT_ACTION`` only where the moment is CRIU's own
(``CRTOOLS_ACTIONS``), and at the points where CRIU runs the CRIU action scripts to hand to it
(``CKPT_CRIU_ACTION_SCRIPTS``)), runs
without a shell in its own session, as a subreaper whose whole process tree is followed (also
what leaves its session, as ``criu restore --restore-detached`` does), and on timeout that
tree and its process group get SIGTERM, a grace period, then SIGKILL; what a failed hook left
running is ended too. A hook writable by group or others, or owned by another user (other
than root), is refused, and so is one in a folder (``hooks_dir`` or the point's) that is:
whoever may write there may put a hook there; a symlinked one is checked link by link up to
its target (``security.trusted_path``). What a failure does is the caller's business
(``policy.HOOK_FAILURE``).
Neighbours: ``session`` runs the points and ``policy`` says what a failure does;
``protocol.HookRun`` is what the journal keeps; ``procutil.ProcessTree`` follows a hook's
tree; ``security`` judges paths.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ckpt_controller.errors import ConfigError, HookError, HookTimeoutError
from ckpt_controller.procutil import OutputReader, ProcessTree, ended_within, hook_preexec
from ckpt_controller.protocol import HookRun
from ckpt_controller.security import check_owner_and_mode, trusted_path
from ckpt_controller.vocab import HookPoint

log = logging.getLogger("ckpt_controller.hooks")

#: the hook points, in cycle order; what a failure at each does is ``policy.HOOK_FAILURE``
POINTS: tuple[HookPoint, ...] = tuple(HookPoint)
#: ``CRTOOLS_SCRIPT_ACTION`` at the points whose moment is CRIU's own: ``dump`` runs before the
#: dump begins, with the tree running, as CRIU's pre-dump. No other point is at a moment of
#: CRIU's (CRIU's post-dump runs with the tree still frozen, its post-restore with the tree
#: restored but stopped): a script written for CRIU is given to CRIU itself
#: (``criu_action_scripts``, the shipped hooks' ``--action-script``) to run at those.
CRTOOLS_ACTIONS = {HookPoint.DUMP: "pre-dump"}
#: the points where CRIU runs (the shipped criu-dump, criu-restore): the hooks there get the
#: config's ``criu_action_scripts``, one path a line, in ``CKPT_CRIU_ACTION_SCRIPTS``
CRIU_POINTS = (HookPoint.DUMP, HookPoint.PRE_RESTORE)
TAIL_BYTES = 4096


@dataclass(frozen=True)
class HookContext:
    engine: str
    pid: int | None
    state: str
    generation: int
    op_id: str
    image_dir: Path
    deadline_wall: float
    #: pre-restore run after a failed capture, to give back what the dump hooks took
    undo_capture: bool = False
    #: the operation's own hook settings (``OperationCommand.hook_env``), over the
    #: controller's environment
    extra_env: tuple[tuple[str, str], ...] = ()
    #: the config's ``criu_action_scripts``, checked again just before (``CRIU_POINTS``)
    criu_action_scripts: tuple[str, ...] = ()
    #: set when the controller stops (SIGTERM): a running hook is ended at once (SIGTERM,
    #: the grace, SIGKILL, its whole tree), as at its timeout, and no further hook starts
    stop: threading.Event | None = None


def find_hooks(hooks_dir: Path | None, point: str) -> list[Path]:
    """The executables serving ``point``, in name order; refuses unsafe ones."""
    if point not in POINTS:
        raise ConfigError("unknown hook point", point=point, allowed=list(POINTS))
    if hooks_dir is None or not (hooks_dir / point).is_dir():
        return []
    for folder in (hooks_dir, hooks_dir / point):
        check_owner_and_mode(folder, "hook folder")
    found = []
    for path in sorted((hooks_dir / point).iterdir()):
        if path.name.startswith(".") or path.name.endswith(("~", ".md", ".txt")):
            continue
        real = trusted_path(path, "hook")  # a link: its target and every folder on the way
        if not real.is_file() or not os.access(real, os.X_OK):
            # refused, not skipped: a dump hook installed without chmod +x would otherwise
            # let a capture succeed having captured nothing
            raise ConfigError(f"hook {path.name} at {point} is not an executable file: "
                              f"chmod +x it, or start its name with '.' to set it aside",
                              path=str(path), point=point)
        found.append(path)
    return found


def action_scripts(config_scripts, key: str = "controller.criu_action_scripts") -> tuple[str, ...]:
    """The config's CRIU action scripts as CRIU is to run them (their real paths), each an
    executable file that only we or root can change (CRIU runs them as root); else
    ``ConfigError`` naming the key (``controller.criu_action_scripts[N]``)."""
    out = []
    for i, path in enumerate(config_scripts):
        try:
            if "\n" in str(path):  # the hooks hand them on one a line
                raise ConfigError(f"{path!r}: a path with a line break", path=str(path))
            real = trusted_path(path, "CRIU action script", strict_folder=False)
            if not real.is_file() or not os.access(real, os.X_OK):
                raise ConfigError(f"{path} is not an executable file", path=str(path))
        except (ConfigError, OSError) as err:  # policy: refused, naming the key, as a hook
            raise ConfigError(f"{key}[{i}]: {getattr(err, 'message', err)}", key=f"{key}[{i}]",
                              path=str(path)) from None
        out.append(str(real))
    return tuple(out)


def crtools_readers(hooks_dir: Path | None) -> list[Path]:
    """Hooks at points other than ``dump`` whose text reads ``CRTOOLS_SCRIPT_ACTION``: they
    were given it once, and are no longer (their moment is not CRIU's: a script written for
    CRIU belongs in ``criu_action_scripts``). Said at ``serve --check`` and at start."""
    out = []
    for point in POINTS:
        if point in CRTOOLS_ACTIONS:
            continue
        for path in find_hooks(hooks_dir, point):
            try:
                with open(path, "rb") as f:
                    head = f.read(1 << 16)
            except OSError:  # policy: unreadable here: the hook's run will say so
                continue
            if b"CRTOOLS_SCRIPT_ACTION" in head:
                out.append(path)
    return out


def hook_env(point: str, ctx: HookContext) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "CKPT_ACTION": point,
        "CKPT_ENGINE": ctx.engine,
        "CKPT_ENGINE_PID": str(ctx.pid or ""),
        "CKPT_STATE": ctx.state,
        "CKPT_GENERATION": str(ctx.generation),
        "CKPT_OP_ID": ctx.op_id,
        "CKPT_IMAGE_DIR": str(ctx.image_dir),
        "CKPT_DEADLINE": f"{ctx.deadline_wall:.3f}",
        "CRTOOLS_INIT_PID": str(ctx.pid or ""),
    })
    # neither may come from the controller's own environment: an action for a moment that is
    # not CRIU's, or scripts no check saw that CRIU would run as root
    env.pop("CRTOOLS_SCRIPT_ACTION", None)
    env.pop("CKPT_CRIU_ACTION_SCRIPTS", None)
    if point in CRTOOLS_ACTIONS:
        env["CRTOOLS_SCRIPT_ACTION"] = CRTOOLS_ACTIONS[point]
    if point in CRIU_POINTS and ctx.criu_action_scripts:
        env["CKPT_CRIU_ACTION_SCRIPTS"] = "\n".join(ctx.criu_action_scripts)
    if ctx.undo_capture:
        env["CKPT_UNDO_CAPTURE"] = "1"
    env.update(ctx.extra_env)
    return env


def run_hook(path: Path, point: str, ctx: HookContext, timeout_s: float,
             grace_s: float = 5.0) -> HookRun:
    """Run one hook to its end or its timeout; never raises for the hook's own failure.
    It gets SIGTERM if the controller dies while it runs (``hook_preexec``). The hook is
    made a subreaper, so whatever it starts stays in its tree even when it
    leaves the hook's session (``criu restore --restore-detached``): on a timeout that whole
    tree gets SIGTERM, the grace, then SIGKILL; after a failure what the hook left running
    is ended the same way. After a success it is left alone (a restored engine)."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen([str(path)], env=hook_env(point, ctx), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, cwd=str(ctx.image_dir),
                                preexec_fn=hook_preexec(os.getpid()))
    except (OSError, subprocess.SubprocessError) as exc:  # policy: a hook that cannot start
        # is a failed hook (exit 127)
        return HookRun(point=point, path=str(path), exit_code=127,
                       duration_s=time.monotonic() - start, stderr_tail=f"cannot run: {exc}")
    # the hook's process group, then its tree as seen, so a controller restarted after a
    # crash can stop them
    pidfile = ctx.image_dir / f".hook-{point}-{proc.pid}.pid"
    write_pidfile(pidfile, f"{proc.pid}\n")
    tree = ProcessTree(proc.pid)
    reader = OutputReader(proc.stdout, proc.stderr)
    timed_out = False
    grace_left = grace_s
    if not _wait(proc, tree, timeout_s, pidfile, ctx.stop):
        timed_out = True
        if ctx.stop is not None and ctx.stop.is_set():
            log.warning("hook %s (%s) ended: the controller is stopping: SIGTERM", path, point)
        else:
            log.warning("hook %s (%s) passed its %.1fs timeout: SIGTERM", path, point,
                        timeout_s)
        tree.look()
        term_at = time.monotonic()
        _signal_group(proc, signal.SIGTERM)
        tree.signal(signal.SIGTERM)
        if not _wait(proc, tree, grace_s, pidfile):
            log.warning("hook %s ignored SIGTERM for %.1fs: SIGKILL", path, grace_s)
            _signal_group(proc, signal.SIGKILL)
            tree.signal(signal.SIGKILL)
            proc.wait()
        grace_left = max(0.0, term_at + grace_s - time.monotonic())
    pidfile.unlink(missing_ok=True)
    out, err = reader.finish()
    if timed_out or proc.returncode != 0:
        tree.end(grace_left)
        if tree.signalled:
            pids = " ".join(map(str, sorted(tree.signalled)))
            log.warning("hook %s (%s): stopped processes it started: %s", path, point, pids)
            err = (err or b"") + (f"\n[ckpt-controller: stopped processes the hook started, "
                                  f"detached ones included: {pids}]\n").encode()
    return HookRun(point=point, path=str(path), exit_code=proc.returncode,
                   duration_s=time.monotonic() - start, timed_out=timed_out,
                   stdout_tail=_tail(out), stderr_tail=_tail(err))


#: how often a running hook's process tree is looked at (to follow what detaches from it)
LOOK_EVERY_S = 0.25


def write_pidfile(pidfile: Path, text: str) -> None:
    """Replace ``pidfile``'s content at once (a temp file renamed over it): a controller killed
    mid-write, or a reader, sees the old record or the new one, never an empty file, which
    would leave a crashed controller's hook running unseen by the next."""
    tmp = pidfile.with_name(f".tmp{pidfile.name}")
    tmp.write_text(text)
    os.replace(tmp, pidfile)


def _wait(proc: subprocess.Popen, tree: ProcessTree, seconds: float, pidfile: Path,
          stop: threading.Event | None = None) -> bool:
    """Whether the hook ended within ``seconds`` (and before ``stop`` was set); looks at its
    process tree meanwhile and keeps ``pidfile`` up to date with it."""
    deadline = time.monotonic() + seconds
    while True:
        if stop is not None and stop.is_set() and proc.poll() is None:
            return False
        before = set(tree.seen)
        tree.look()
        if set(tree.seen) != before:
            write_pidfile(pidfile, f"{proc.pid}\n{tree.record()}")
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if ended_within(proc, min(LOOK_EVERY_S, left)):
            return True


def stop_orphan_hooks(engine_image_dir: Path, op_id: str, grace_s: float = 5.0) -> int:
    """After a controller crash: stop hooks of ``op_id`` still running (SIGTERM, grace,
    SIGKILL to each process group and to what its runner saw it start, detached parts
    included), so recovery never races a half-finished dump or restore."""
    folder = engine_image_dir / op_id.replace("/", "_")
    stopped = 0
    for tmp in folder.glob(".tmp.hook-*.pid") if folder.is_dir() else []:
        tmp.unlink(missing_ok=True)  # a write its crashed controller never finished
    for pidfile in folder.glob(".hook-*.pid") if folder.is_dir() else []:
        first, _, rest = pidfile.read_text().partition("\n")
        # what the hook started, detached parts included, as its runner last saw it
        tree = ProcessTree.recorded(0, rest)
        try:
            pgid = int(first)
            os.killpg(pgid, signal.SIGTERM)
        except (ValueError, ProcessLookupError, PermissionError):  # policy: gone, or not ours
            pgid = 0
        if pgid == 0 and not tree.alive():
            pidfile.unlink(missing_ok=True)
            continue
        tree.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (pgid and _group_alive(pgid) or tree.alive()):
            time.sleep(0.05)
        if pgid and _group_alive(pgid):
            _kill_group(pgid)
        tree.signal(signal.SIGKILL)
        tree.wait(5.0)
        log.warning("stopped hook process group %s and %d more of its processes left by an "
                    "interrupted operation", pgid or "(gone)", len(tree.signalled))
        pidfile.unlink(missing_ok=True)
        stopped += 1
    return stopped


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):  # policy: no such group left
        return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # policy: already gone
        pass


def run_point(hooks_dir: Path | None, point: str, ctx: HookContext, timeout_s: float,
              runs: list[HookRun], until_wall: float | None = None,
              grace_s: float = 5.0) -> None:
    """Run every hook of ``point`` in order, appending each run to ``runs``; raise
    ``HookError`` at the first failure (the caller applies ``policy.HOOK_FAILURE``). Each hook
    gets ``timeout_s``, cut to the operation's deadline and to ``until_wall`` (a limit the
    point's hooks share, such as the capture deadline)."""
    for path in find_hooks(hooks_dir, point):
        if ctx.stop is not None and ctx.stop.is_set():
            raise HookError(f"{point} hook {path.name} not started: the controller is "
                            "stopping", engine=ctx.engine, point=point, path=str(path),
                            stopping=True)
        end = ctx.deadline_wall if until_wall is None else min(ctx.deadline_wall, until_wall)
        left = max(0.1, min(timeout_s, end - time.time()))
        run = run_hook(path, point, ctx, left, grace_s=grace_s)
        runs.append(run)
        if not run.timed_out and run.exit_code == 0 and run.stderr_tail.strip():
            # a hook that succeeded and still wrote to stderr warns (tcp-hold: a hold that
            # lasted past its bound)
            said = " | ".join(ln.strip() for ln in run.stderr_tail.splitlines() if ln.strip())
            log.warning("%s: %s hook %s: %s", ctx.engine, point, path.name, said[-1000:])
        if run.timed_out or run.exit_code != 0:
            what = "timed out" if run.timed_out else f"exited {run.exit_code}"
            if run.timed_out and ctx.stop is not None and ctx.stop.is_set():
                what = "was ended: the controller is stopping"
            error = HookTimeoutError if run.timed_out else HookError
            said = _first_line(run.stderr_tail)
            raise error(f"{point} hook {path.name} {what}" + (f": {said}" if said else ""),
                        engine=ctx.engine, point=point,
                        path=str(path), exit_code=run.exit_code, timed_out=run.timed_out,
                        stderr_tail=run.stderr_tail[-1000:])


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # policy: already gone is what we wanted
        pass


def _first_line(tail: str) -> str:
    """The first whole line a hook wrote to stderr (its own words on why it failed), short;
    not the runner's note on what it stopped."""
    lines = tail.splitlines()
    if len(tail.encode()) >= TAIL_BYTES:
        lines = lines[1:]  # the tail began inside a line
    for line in lines:
        if line.strip() and not line.startswith("[ckpt-controller:"):
            return line.strip()[:300]
    return ""


def _tail(data: bytes | None) -> str:
    return (data or b"")[-TAIL_BYTES:].decode("utf-8", "replace")


def install_criu_dump_hook(hooks_dir: Path) -> str:
    """Link the shipped criu-dump hook when CRIU is installed; else say why not."""
    root = Path(__file__).resolve().parents[2]
    hook = root / "hooks" / "criu-dump"
    from ckpt_controller.criu_images import criu_path

    criu = criu_path()
    if not hook.exists():
        return "the criu-dump hook is not next to this installation"
    if not os.path.exists(criu):
        return "CRIU is not installed; `make criu` installs it"
    if os.geteuid() != 0:
        return "CRIU needs root"
    (hooks_dir / HookPoint.DUMP).mkdir(parents=True, exist_ok=True)
    (hooks_dir / HookPoint.DUMP / "10-criu-dump").symlink_to(hook)
    return "installed"
