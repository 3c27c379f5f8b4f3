"""The controller's claim on its state directory and endpoint, made when it starts.

``claim(config)`` runs before the journal opens and before the endpoint is bound. It makes the
state and image directories, checks the hooks directory and the folder an ``ipc://`` endpoint
lives in, and takes an exclusive ``flock`` on the state directory itself (its inode: deleting a
file cannot let a second controller in) and on ``<state_dir>/controller.lock``, with this
process's PID written in it for the message a second one gets. The locks are held for the life
of the process; the kernel lets go
of it when the process dies, kill -9 included. A second controller on the same state directory
is refused, naming the holder's PID, so two never write one journal. An ``ipc://`` endpoint is
held the same way from the claim on (``<socket>.lock`` beside the socket file), not only once
it is bound: ``serve`` recovers interrupted operations before it binds, and a controller of
another state directory started meanwhile must not bind a socket the first then takes from it.
A socket file that is already there is reclaimed when nothing listens on it (a controller
killed before it could remove it) and refused when something does; ``Claim.release`` removes
the socket file and its lock file at exit, while the locks are still held. Every problem is a
``ConfigError`` naming the file and key.
Neighbours: ``config`` (the values checked), ``service`` (holds the claim while it runs).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from ckpt_controller.controller.config import ControllerConfig, key_error
from ckpt_controller.endpoints import listening
from ckpt_controller.errors import ConfigError
from ckpt_controller.security import private_dir

log = logging.getLogger("ckpt_controller.controller")

LOCK_NAME = "controller.lock"


class Claim:
    """A held state directory (the locked ``controller.lock`` and directory) and the
    endpoint's file."""

    def __init__(self, held: tuple[int, int], socket_path: Path | None,
                 endpoint_fd: int | None = None) -> None:
        self._held: tuple[int, int] | None = held
        self.socket_path = socket_path
        self._endpoint_fd = endpoint_fd

    def release(self) -> None:
        """Remove the endpoint's socket file unless another process listens on it, and its
        lock file, then let go of the locks. Idempotent."""
        if self._held is None:
            return
        if self.socket_path is not None and self.socket_path.is_socket() \
                and not listening(self.socket_path):
            self.socket_path.unlink(missing_ok=True)
        if self._endpoint_fd is not None:
            _lock_path(self.socket_path).unlink(missing_ok=True)  # still held: no one waits
            os.close(self._endpoint_fd)
            self._endpoint_fd = None
        release_lock(self._held)  # closing the only descriptors releases the flocks
        self._held = None


def claim(config: ControllerConfig) -> Claim:
    """Check what only the running system can tell and take the state directory's lock."""
    _make_dir(config, "controller.state_dir", config.state_dir)
    held = _lock(config)
    try:
        _make_dir(config, "controller.image_dir", config.image_dir)
        if config.hooks_dir is not None and not config.hooks_dir.is_dir():
            what = "is not a directory" if config.hooks_dir.exists() else "does not exist"
            raise key_error(config, "controller.hooks_dir", f"{config.hooks_dir} {what}; create "
                            "it (hooks live in <hooks_dir>/<point>/) or leave the key out",
                            path=str(config.hooks_dir))
        from ckpt_controller.controller.hooks import action_scripts, crtools_readers

        # CRIU runs them as root: refused at start, not at the first dump
        action_scripts(config.criu_action_scripts)
        try:
            readers = crtools_readers(config.hooks_dir)
        except ConfigError:  # policy: an unsafe hook is refused when its point runs
            readers = []
        for path in readers:
            log.warning("hook %s reads CRTOOLS_SCRIPT_ACTION, which only the dump point sets "
                        "now: a script for CRIU's own moments goes in "
                        "controller.criu_action_scripts (docs/hooks.md)", path)
        socket_path = _endpoint_file(config)
        endpoint_fd = _lock_endpoint(config, socket_path) if socket_path is not None else None
    except BaseException:  # policy: a refused start holds nothing
        release_lock(held)
        raise
    try:
        if socket_path is not None:
            _reclaim(config, socket_path)
    except BaseException:  # policy: a refused start holds nothing
        _lock_path(socket_path).unlink(missing_ok=True)
        os.close(endpoint_fd)
        release_lock(held)
        raise
    return Claim(held, socket_path, endpoint_fd)


def check(config: ControllerConfig) -> list[str]:
    """What ``claim`` would refuse, found without changing anything (``ckptctl serve
    --check``): the state and image directories (there and private, or creatable), the hooks
    directory and every hook in it, the CRIU action scripts, the endpoint's folder, CURVE key
    files. Returns what it looked at, a line each; raises the ``ConfigError`` ``claim``
    would."""
    from ckpt_controller.controller.hooks import (POINTS, action_scripts, crtools_readers,
                                                  find_hooks)

    seen = []
    for key, path in (("controller.state_dir", config.state_dir),
                      ("controller.image_dir", config.image_dir)):
        if path.exists():
            if not path.is_dir():
                raise key_error(config, key, f"{path} exists and is not a directory",
                                path=str(path))
            try:
                private_dir(path, key.rpartition(".")[2].replace("_dir", " directory"))
            except ConfigError as err:  # policy: refused as claim refuses it, naming the key
                raise key_error(config, key, f"{err.details.get('path', path)}: "
                                f"{err.message}", path=str(path)) from None
            seen.append(f"{key} {path}: a private directory")
        else:
            parent = next(p for p in path.parents if p.exists())
            if not os.access(parent, os.W_OK | os.X_OK):
                raise key_error(config, key, f"cannot create {path}: {parent} is not writable",
                                path=str(path))
            seen.append(f"{key} {path}: to be created")
    if config.hooks_dir is not None:
        if not config.hooks_dir.is_dir():
            what = "is not a directory" if config.hooks_dir.exists() else "does not exist"
            raise key_error(config, "controller.hooks_dir", f"{config.hooks_dir} {what}",
                            path=str(config.hooks_dir))
        hooks = {point: find_hooks(config.hooks_dir, point) for point in POINTS}
        seen.append(f"controller.hooks_dir {config.hooks_dir}: " + (", ".join(
            f"{point} {len(found)}" for point, found in hooks.items() if found) or "no hooks"))
        seen += [f"{path}: reads CRTOOLS_SCRIPT_ACTION, which only the dump point sets now "
                 "(a script for CRIU's own moments goes in controller.criu_action_scripts)"
                 for path in crtools_readers(config.hooks_dir)]
    if config.criu_action_scripts:
        seen.append("controller.criu_action_scripts: "
                    + ", ".join(action_scripts(config.criu_action_scripts)))
    socket_path = _endpoint_file(config)
    if socket_path is not None:
        if not socket_path.parent.is_dir():
            raise key_error(config, "controller.endpoint", f"{socket_path.parent} does not "
                            "exist: create it, or name another folder", path=str(socket_path))
        in_use = socket_path.is_socket() and listening(socket_path)
        seen.append(f"controller.endpoint {config.endpoint}: "
                    + ("another process serves it now" if in_use else "free"))
    for key, path in (("controller.curve_secret_key", config.curve_secret_key),
                      ("controller.curve_clients", config.curve_clients)):
        if path is not None and not path.exists():
            raise key_error(config, key, f"{path} does not exist", path=str(path))
    return seen


def _make_dir(config: ControllerConfig, key: str, path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:  # policy: a file (or a dangling link) where a folder must be
        raise key_error(config, key, f"{path} exists and is not a directory",
                        path=str(path)) from None
    except OSError as err:  # policy: read-only, /proc, no permission: the person picks another
        raise key_error(config, key, f"cannot create {path}: {err.strerror or err}",
                        path=str(path)) from None
    try:  # criu-restore restores from the image dir as root; the journal is in the state dir
        private_dir(path, key.rpartition(".")[2].replace("_dir", " directory"))
    except ConfigError as err:  # policy: others could change it: refused, naming the key
        raise key_error(config, key, f"{err.details.get('path', path)}: {err.message}",
                        **err.details) from None


def hold_lock(config: ControllerConfig) -> tuple[int, int]:
    """The state directory's lock, held (``release_lock`` lets go), for work done with the
    controller stopped (``ckptctl journal salvage``); ``ConfigError`` naming the controller's
    PID while one runs."""
    return _lock(config)


def release_lock(held: tuple[int, int]) -> None:
    """Let go of what ``_lock`` took: ``controller.lock`` and the directory's own lock."""
    for fd in held:
        os.close(fd)


def _lock(config: ControllerConfig) -> tuple[int, int]:
    """Lock the state directory itself (its inode: deleting ``controller.lock`` lets no
    second controller in; deleted, a second one once ran on the same journal), then
    ``controller.lock``, which holds our PID for the message a second one gets."""
    path = config.state_dir / LOCK_NAME
    try:
        dfd = os.open(config.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:  # policy: a state directory we cannot open is unusable
        raise key_error(config, "controller.state_dir", f"cannot open {config.state_dir}: "
                        f"{err.strerror or err}", path=str(config.state_dir)) from None
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(dfd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # policy: no locks there
            raise key_error(config, "controller.state_dir", f"cannot lock "
                            f"{config.state_dir}: {err.strerror or err}",
                            path=str(config.state_dir)) from None
        try:
            holder = path.read_text().strip() or "unknown"
        except OSError:  # policy: its PID file deleted: the lock still says it runs
            holder = "unknown"
        raise _in_use(config, path, holder) from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:  # policy: a state directory we cannot write in is unusable
        os.close(dfd)
        raise key_error(config, "controller.state_dir", f"cannot write in {config.state_dir}: "
                        f"{err.strerror or err}", path=str(path)) from None
    holder = _flock(config, "controller.state_dir", fd, path)
    if holder is not None:
        os.close(dfd)
        raise _in_use(config, path, holder)
    return fd, dfd


def _in_use(config: ControllerConfig, path: Path, holder: str) -> ConfigError:
    return key_error(config, "controller.state_dir",
                     f"{config.state_dir} is in use by another controller (pid {holder}); "
                     "one controller per state directory", path=str(path),
                     holder_pid=int(holder) if holder.isdigit() else None)


def _flock(config: ControllerConfig, key: str, fd: int, path: Path) -> str | None:
    """Lock ``fd`` (the open ``path``) and write our PID in it; None when it is ours, else
    the holder's PID as written (``fd`` is closed then)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # policy: no locks there
            raise key_error(config, key, f"cannot lock {path}: {err.strerror or err}",
                            path=str(path)) from None
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return None


def _lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".lock")


def _lock_endpoint(config: ControllerConfig, socket_path: Path) -> int:
    """Hold ``<socket>.lock`` for the life of the process: one controller per ``ipc://``
    endpoint, whether it has bound it yet or not. A lock file its holder removed while we
    opened it is opened again."""
    path = _lock_path(socket_path)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as err:  # policy: a folder we cannot write in cannot hold our socket
            raise key_error(config, "controller.endpoint", f"cannot create {path}: "
                            f"{err.strerror or err}", path=str(path)) from None
        holder = _flock(config, "controller.endpoint", fd, path)
        if holder is not None:
            raise key_error(config, "controller.endpoint",
                            f"{socket_path} is held by another controller (pid {holder}) of "
                            "another state directory; one controller per endpoint",
                            path=str(socket_path),
                            holder_pid=int(holder) if holder.isdigit() else None)
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # policy: its holder removed it as it let go: lock anew
            same = False
        if same:
            return fd
        os.close(fd)


def _endpoint_file(config: ControllerConfig) -> Path | None:
    """The socket file of an ``ipc://`` endpoint (None for tcp, inproc and abstract ones),
    after checking its folder exists."""
    if not config.endpoint.startswith("ipc://"):
        return None
    rest = config.endpoint[len("ipc://"):]
    if rest.startswith("@"):  # Linux abstract namespace: no file
        return None
    path = Path(rest)
    if not path.parent.is_dir():
        raise key_error(config, "controller.endpoint", f"the folder of {path} does not exist",
                        path=str(path))
    return path


def _reclaim(config: ControllerConfig, path: Path) -> None:
    """With the endpoint's lock held: refuse a socket file something else serves on, remove
    one nothing listens on (left by a controller that was killed)."""
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise key_error(config, "controller.endpoint", f"{path} exists and is not a socket",
                            path=str(path))
        if listening(path):
            raise key_error(config, "controller.endpoint", f"another process serves on {path}",
                            path=str(path))
        path.unlink(missing_ok=True)  # left by a controller that was killed: reclaimed
