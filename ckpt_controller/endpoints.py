"""Where control endpoints live: ipc:// socket files in a private directory by default.

``default_endpoint(name)`` gives ``ipc://<runtime dir>/<name>.sock`` where the runtime dir is
``$XDG_RUNTIME_DIR/ckpt-controller`` or ``/tmp/ckpt-controller-<uid>``, created mode 0700.
``secure_ipc(endpoint)`` makes a bound socket file mode 0600. tcp:// endpoints pass through.
``free_port()`` finds a loopback TCP port nobody listens on (the demo's and the drill's
engines); ``cannot_bind`` is the one error for an endpoint a server could not bind;
``Resolve`` is the shape of what tells a client where an engine is reached now (the fleet's
registry supplies one: ``fleet.registry.Resolver``); ``watch_changes`` is how a client hears
from a resolver that watches. Imports nothing of the project but ``errors``, so the CLI's
parser may use it.
Neighbours: ``rpc`` and ``rpcserver`` (check and secure endpoints), ``agent.server``,
``controller.config``, ``adapters.vllm.state`` (the runtime dir), the CLI, ``drill.runner``.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path
from typing import Protocol

from ckpt_controller.errors import CkptError, ConfigError


class Resolve(Protocol):
    """Where an engine is reached now: ``resolve(engine, kind)`` is its endpoint of ``kind``
    (``api``, ``http``); ``close`` ends what the resolver holds. Clients that follow an engine
    across migrations take one (``EngineClient.for_engine``, ``FollowingVllm``). A resolver
    may also have ``watch(engine, wake)``: ``wake()`` from a thread of its own whenever
    where the engine is may have changed (the fleet's registry does); clients then look it up
    again at once instead of after a silence."""

    def __call__(self, engine: str, kind: str) -> str: ...

    def close(self) -> None: ...


#: how often a client whose resolver watches looks, while it waits, whether the record changed
WATCH_SLICE_S = 0.02


def watch_changes(resolve: Resolve, engine: str) -> threading.Event | None:
    """An event set whenever ``resolve``'s watch says where ``engine`` is may have changed
    (the clients clear it when they look again); None for a resolver without ``watch``."""
    watch = getattr(resolve, "watch", None)
    if watch is None:
        return None
    changed = threading.Event()
    watch(engine, changed.set)
    return changed


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
    """``endpoint`` if it is one zmq can bind or connect: ``ipc://PATH``, ``inproc://NAME``
    or ``tcp://HOST:PORT``, else a ``ConfigError`` naming it and what is wrong. zmq takes an
    address it cannot use (``tcp://256.1.1.1:5``, a port past 65535) for a host name to look
    up and keeps retrying it, which a client would report as nothing listening: such an
    address is refused here at once. HOST is a dotted-quad IPv4 address, an IPv6 address
    (``[::1]``), ``*`` (every interface, to bind), or a host or interface name, looked up when
    used; PORT is 0 to 65535 (0 or ``*``: any free port, to bind). zmq's
    ``tcp://SOURCE;HOST:PORT`` (connect from SOURCE) passes when both parts do."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://",
                                                                 "inproc://")):
        raise ConfigError("endpoint must start with ipc://, tcp:// or inproc://", endpoint=endpoint)
    scheme, address = endpoint.split("://", 1)
    if not address:
        raise ConfigError("endpoint names no address after the scheme", endpoint=endpoint)
    if scheme == "tcp":
        # zmq's source-address form, ``tcp://SOURCE;HOST:PORT`` (connect from SOURCE, an
        # interface or address, with or without a port): each part checked on its own
        source, semi, address = address.rpartition(";")
        problem = _tcp_problem(address) or (semi and _source_problem(source))
        if problem:
            raise ConfigError(f"endpoint is not a valid tcp://HOST:PORT address: {problem}",
                              endpoint=endpoint)
    return endpoint


def _tcp_problem(address: str) -> str | None:
    """What is wrong with ``HOST:PORT`` (``None``: nothing)."""
    import ipaddress

    host, colon, port = address.rpartition(":")
    if not colon:
        return "no :PORT"
    if port != "*" and not (port.isascii() and port.isdigit() and len(port) <= 5
                            and int(port) <= 65535):
        return f"port {port!r} is not a number from 0 to 65535"
    if host == "*":
        return None
    bracketed = host.startswith("[") and host.endswith("]")
    ip = host[1:-1] if bracketed else host
    try:
        if ":" in ip:
            ipaddress.IPv6Address(ip)
        elif _NUMERIC_HOST.fullmatch(ip):  # numbers: an IPv4 address, never a name
            ipaddress.IPv4Address(ip)
        elif bracketed or len(host) > 253 or not _HOST_NAME.fullmatch(host):
            return (f"host {host!r} is not an IP address, '*' or a host or interface name "
                    "(letters, digits, '.', '_', '-'; at most 253)")
    except ValueError as err:  # policy: the address's own fault, said with the endpoint
        return f"host {host!r} is not an IP address ({err})"
    return None


def _source_problem(source: str) -> str | None:
    """What is wrong with a source address (``HOST`` or ``HOST:PORT``), ``None``: nothing."""
    if not source:
        return "nothing before ';' (the source address)"
    if source.startswith("["):  # IPv6, with a port after the bracket or without one
        return _tcp_problem(source if "]:" in source else f"{source}:0")
    if source.count(":") == 1:  # a name or an IPv4 address, and a port
        return _tcp_problem(source)
    return _tcp_problem(f"{source}:0")  # a bare host


#: a host of digits and dots only is meant as an IPv4 address (no top-level domain is numeric)
_NUMERIC_HOST = re.compile(r"[0-9.]+")
#: a DNS name or a network interface's name (``eth0``, ``br-lan``)
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*\.?[A-Za-z0-9_-])*\.?")


def cannot_bind(endpoint: str, problem: BaseException) -> CkptError:
    """The error of a server that could not bind ``endpoint`` (a folder that does not exist,
    a port in use): it names the endpoint (``details['endpoint']``) and the system's reason,
    whichever socket it was (a control endpoint, the reference engine's request API)."""
    return CkptError(f"cannot bind {endpoint}: {problem}", endpoint=endpoint)


def secure_ipc(endpoint: str) -> None:
    """Restrict a bound ipc socket file to its owner (0600)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if path and not path.startswith("@"):  # '@' = Linux abstract namespace, no file
            os.chmod(path, 0o600)


def listening(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path``."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):  # policy: nobody there: stale
            return False
        except OSError:  # policy: cannot tell (no permission, timeout): assume it is in use
            return True
        return True


def remove_stale_ipc(endpoint: str | None) -> None:
    """After a server closed its socket on ``endpoint``: remove the ipc socket file zmq
    leaves behind, unless another process listens there now (a copy of the server that CRIU
    restored beside it binds the same path). tcp:// endpoints and abstract names (``@``)
    have no file; anything at the path that is not a socket is left alone."""
    if not endpoint or not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    if str(path).startswith("@") or not path.is_socket() or listening(path):
        return
    path.unlink(missing_ok=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (another process may take it first:
    a bind that fails says so)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_host(host: str) -> str:
    """The IP address ``host`` names: itself when it is one, else what the host's resolver
    gives for the name (an IPv4 address first). CRIU's page server and its dump connect only
    to an address (a name is ``Invalid server address``). ``ConfigError`` when the name does
    not resolve, saying so."""
    import ipaddress
    import socket

    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:  # policy: not an IP address: a name, looked up below
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # policy: a name that does not resolve is refused
        raise ConfigError(f"host name {host!r} does not resolve to an address ({err}): give "
                          "[fleet] address as this node's IP address", key="fleet.address",
                          address=host, problem=str(err)) from None
    v4 = [info[4][0] for info in found if info[0] == socket.AF_INET]
    return (v4 or [info[4][0] for info in found])[0]


def check_local_address(address: str, ip: str) -> None:
    """``ConfigError`` unless ``ip`` (what ``[fleet] address`` ``address`` resolved to) is an
    address of this host, or of the network namespace this runs in: the target's page server
    listens there, and an address that is not one of its own cannot be listened on (found
    before, it failed a migration after the whole send)."""
    import socket

    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError as err:  # policy: not ours to listen on: the config is wrong
            raise ConfigError(
                f"[fleet] address {address!r} ({ip}) is not an address of this host or "
                f"network namespace ({err.strerror}): give the address the other nodes reach "
                "this one at", key="fleet.address", address=address, ip=ip) from None
