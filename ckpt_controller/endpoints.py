"""Where control endpoints live: ipc:// socket files in a private directory by default.

``default_endpoint(name)`` gives ``ipc://<runtime dir>/<name>.sock`` where the runtime dir is
``$XDG_RUNTIME_DIR/ckpt-controller`` or ``/tmp/ckpt-controller-<uid>``, created mode 0700.
``secure_ipc(endpoint)`` makes a bound socket file mode 0600. tcp:// endpoints pass through.
``free_port()`` finds a loopback TCP port nobody listens on (the demo's and the drill's
engines). Imports nothing of the project but ``errors``, so the CLI's parser may use it.
Neighbours: ``rpc`` and ``rpcserver`` (check and secure endpoints), ``agent.server``,
``controller.config``, ``adapters.vllm.state`` (the runtime dir), the CLI, ``drill.runner``.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ckpt_controller.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def runtime_dir_path() -> Path:
    """Where the runtime dir is, without creating it (``ckptctl --help`` names it)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "ckpt-controller" if base else Path(f"/tmp/ckpt-controller-{os.getuid()}")


def default_controller_endpoint() -> str:
    """The controller's endpoint when none is named: ``$CKPT_CONTROLLER``, else
    ``ipc://<runtime dir>/controller.sock`` (``ckptctl --controller``, ``ControllerClient``)."""
    if os.environ.get("CKPT_CONTROLLER"):
        return os.environ["CKPT_CONTROLLER"]
    return f"ipc://{runtime_dir_path() / 'controller.sock'}"


def runtime_dir() -> Path:
    """The runtime dir, created mode 0700; a ``ConfigError`` when someone else could use it."""
    path = runtime_dir_path()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError("runtime directory is not private to this user", path=str(path),
                          mode=oct(stat.S_IMODE(st.st_mode)), owner=st.st_uid)
    return path


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError("engine name must be 1-64 letters, digits, '.', '_' or '-'", name=name)
    return name


def default_endpoint(name: str) -> str:
    return f"ipc://{runtime_dir() / check_name(name)}.sock"


def check_endpoint(endpoint: str) -> str:
    if not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
        raise ConfigError("endpoint must start with ipc://, tcp:// or inproc://", endpoint=endpoint)
    return endpoint


def secure_ipc(endpoint: str) -> None:
    """Restrict a bound ipc socket file to its owner (0600)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if path and not path.startswith("@"):  # '@' = Linux abstract namespace, no file
            os.chmod(path, 0o600)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (another process may take it first:
    a bind that fails says so)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
