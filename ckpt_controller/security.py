"""CURVE security for TCP control endpoints: key files, server and client socket setup, and
the ZAP handler that admits only authorized client keys and logs refusals at a bounded rate.

The authorized keys (``AllowList``) are read from their folder when the server starts, then
again when the folder changed or, at most once a ``RESCAN_S``, a key file in it did: a
handshake costs a set lookup, whatever the number of keys or of handshakes (a flood of 3,000
with 1,001 keys read every file for each and kept admitted clients out for 88 s). The folder
must be ours (or root's) and writable by nobody else, as must each key file: one that is not
is refused at start and, found later, admits nobody until it is put right. A file there that
is not a regular, well-formed key file (a FIFO, an empty ``.key``, a key writable by others)
is skipped, said once in the log, and never blocks: the others still admit their clients.
Refusals are logged one by one up to ``REFUSALS_LOGGED`` a ``REFUSAL_WINDOW_S``, then
counted in one line per window.

Key files are ZeroMQ certificates (ZPL text, as pyzmq's ``zmq.auth`` reads them): ``NAME.key``
holds the public key, ``NAME.key_secret`` the public and the secret key and is created with
mode 0600 (a secret file readable by group or others is refused). ``ckptctl keys NAME``
makes a pair. A server (agent or controller) has a secret key and a directory of the public
keys it admits; a client has its own secret key and the server's public key. Public keys
(Z85 text) may appear in logs; secret keys never do: the config and the journal hold paths.

Trusted paths: ``trusted_path`` and ``private_dir`` refuse a file or folder that someone
other than us (or root) could change or replace: hooks (the controller runs them) and the
state and image directories (``criu-restore`` restores from the latter as root).

Why our own ZAP handler and not ``zmq.auth`` (pyzmq 27, read for this): its
``Authenticator`` would do none of the three things this one is for without our code inside it.
Its certificate directory (``configure_curve(location=...)``) is read once, when configured; a
key added or removed takes effect only through ``configure_curve_callback``, whose callback gets
``(domain, key)`` and not the peer's address, so the one refusal line with address and key
would need a subclass reaching into ``handle_zap_message`` (its own lines are DEBUG, address
and key on separate lines); a NULL-mechanism request is admitted unless its address is denied,
where we refuse every mechanism but CURVE. And ``handle_zap_message`` is a coroutine: it needs
an asyncio loop, which ``ThreadAuthenticator`` runs on a thread of its own, where ours answers
on the server's control thread, in the poll it already runs, and closes with its sockets.
What would be left of ``zmq.auth`` is the six-frame reply.

Neighbours: ``rpcserver`` (binds with ``CurveServer``), ``rpc`` (connects with
``CurveClient``), ``controller.config`` and the CLI (where the paths come from),
``controller.hooks`` and ``controller.statedir`` (trusted paths).
"""

from __future__ import annotations

import datetime
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from ckpt_controller.errors import ConfigError, UsageError
from ckpt_controller.files import UnfitFileError, read_small

#: the largest key file read (one holds two 40-character keys and a comment)
MAX_KEY_FILE_BYTES = 64 << 10

log = logging.getLogger("ckpt_controller.security")
#: the authorized keys' files are looked at again at most this often (the folder's own
#: change, a key added or removed, is seen at once)
RESCAN_S = 1.0
#: refused handshakes logged one by one in each window; the rest are counted in one line
REFUSALS_LOGGED = 5
REFUSAL_WINDOW_S = 10.0
#: authentication requests answered in one round of the server's control thread
ZAP_BUDGET = 64

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_BANNER = "#   ckpt-controller CURVE {what} key, made by `ckptctl keys` on {when}\n"


def generate(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (0600); returns both paths."""
    if not zmq.has("curve"):
        raise UsageError("this libzmq was built without CURVE")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists() and not force:
            raise UsageError(f"{path} exists; pass --force to replace it", path=str(path))
    public, secret = zmq.curve_keypair()
    when = datetime.datetime.now().isoformat(timespec="seconds")
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    _write(public_path, _BANNER.format(what="public", when=when) + body, 0o644)
    _write(secret_path, _BANNER.format(what="SECRET", when=when)
           + "#   Do not share this file or loosen its mode.\n"
           + body + f'    secret-key = "{secret.decode()}"\n', 0o600)
    return public_path, secret_path


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)  # never wider, not even once
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def load(path: Path | str, *, secret: bool, what: str = "key") -> tuple[bytes, bytes | None]:
    """(public, secret) from a key file; ``ConfigError`` naming the file otherwise."""
    path = Path(path)
    try:
        st = path.stat()
        text = read_small(path, MAX_KEY_FILE_BYTES).decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}",
                          file=str(path), key=what, problem=str(exc.strerror)) from None
    except UnfitFileError as exc:  # policy: a device, FIFO or huge file is no key file
        raise ConfigError(f"cannot read the {what} file {path}: {exc}", file=str(path),
                          key=what, problem=str(exc)) from None
    keys = {}
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() in ("public-key", "secret-key"):
            keys[name.strip()] = value.strip().strip("'\"").encode()
    public, secret_key = keys.get("public-key"), keys.get("secret-key")
    if public is None or len(public) != 40:
        raise ConfigError(f"{path} holds no CURVE public key", file=str(path), key=what,
                          problem="no public-key")
    if secret:
        if secret_key is None or len(secret_key) != 40:
            raise ConfigError(f"{path} holds no CURVE secret key (is it the .key_secret file?)",
                              file=str(path), key=what, problem="no secret-key")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o});"
                              f" chmod 600 it", file=str(path), key=what, problem="mode")
    return public, secret_key


@dataclass(frozen=True)
class CurveServer:
    """A server's secret key file and the directory of client public keys it admits."""

    secret_key: Path
    clients: Path

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = load(self.secret_key, secret=True, what="secret key")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 0)


class AllowList:
    """The public keys of the ``*.key`` files in ``folder`` (module doc): ``keys()`` raises
    the ``ConfigError`` of a folder that is missing or that others could change."""

    def __init__(self, folder: Path, clock=time.monotonic) -> None:
        self.folder = folder
        self.clock = clock
        self._keys: frozenset[bytes] | None = None
        self._looked = 0.0
        self._folder_sig: tuple | None = None
        #: file name -> (its stat signature, its key or None when skipped)
        self._files: dict[str, tuple[tuple, bytes | None]] = {}

    def keys(self) -> frozenset[bytes]:
        now = self.clock()
        try:
            st = self.folder.stat()
        except OSError:
            st = None
        sig = None if st is None else (st.st_ino, st.st_mtime_ns, st.st_mode, st.st_uid)
        if self._keys is not None and sig == self._folder_sig and now - self._looked < RESCAN_S:
            return self._keys
        self._keys, self._folder_sig = None, sig
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"the authorized keys directory {self.folder} does not exist",
                              file=str(self.folder), key="curve clients", problem="missing")
        private_dir(self.folder, "authorized keys folder")
        self._keys, self._looked = self._scan(), now
        return self._keys

    def _scan(self) -> frozenset[bytes]:
        found, seen = set(), {}
        for entry in sorted(os.scandir(self.folder), key=lambda e: e.name):
            if not entry.name.endswith(".key"):
                continue
            try:
                st = os.stat(entry.path)  # through a link: what it names
            except OSError as err:
                seen[entry.name] = self._skip(entry.name, ("gone",), err.strerror or str(err))
                continue
            sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)
            known = self._files.get(entry.name)
            if known is not None and known[0] == sig:
                seen[entry.name] = known
            else:
                seen[entry.name] = self._read(entry.name, Path(entry.path), st, sig)
            if seen[entry.name][1] is not None:
                found.add(seen[entry.name][1])
        self._files = seen
        return frozenset(found)

    def _read(self, name: str, path: Path, st: os.stat_result, sig: tuple
              ) -> tuple[tuple, bytes | None]:
        if not stat.S_ISREG(st.st_mode):
            return self._skip(name, sig, f"not a regular file but a {_file_kind(st.st_mode)}")
        try:
            check_owner_and_mode(path, f"key file {name}", st)
            return sig, load(path, secret=False, what="authorized key")[0]
        except ConfigError as err:  # policy: one bad file admits nobody less than before
            return self._skip(name, sig, err.message)

    def _skip(self, name: str, sig: tuple, why: str) -> tuple[tuple, None]:
        """A file that admits nobody: said once (until it changes), then left aside."""
        if self._files.get(name, (None,))[0] != sig:
            log.warning("authorized keys: skipped %s in %s: %s", name, self.folder, why)
        return sig, None


def _file_kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "special file"


class RefusalLog:
    """Refusals logged at a bounded rate: ``REFUSALS_LOGGED`` lines a window, then one line
    counting the rest when the window ends (said with the next refusal or ``flush``)."""

    def __init__(self, server: str, clock=time.monotonic) -> None:
        self.server, self.clock = server, clock
        self._window, self._logged, self._held = clock(), 0, 0

    def refused(self, line: str, *args) -> None:
        self.flush()
        if self._logged < REFUSALS_LOGGED:
            self._logged += 1
            log.warning(line, *args)
        else:
            self._held += 1

    def flush(self) -> None:
        now = self.clock()
        if now - self._window < REFUSAL_WINDOW_S:
            return
        if self._held:
            log.warning("%s: refused %d more connection(s) in the last %.0f s (not logged one "
                        "by one)", self.server, self._held, now - self._window)
        self._window, self._logged, self._held = now, 0, 0


@dataclass(frozen=True)
class CurveClient:
    """A client's secret key file and the server's public key file."""

    secret_key: Path
    server_key: Path

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = load(self.secret_key, secret=True, what="secret key")
        server, _ = load(self.server_key, secret=False, what="server key")
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class ZapHandler:
    """Answers libzmq's authentication requests for one context: a CURVE client whose public
    key is in the server's authorized directory gets 200, anyone else 400 and a log line.
    ``handle`` runs on the server's control thread (it polls ``socket``)."""

    def __init__(self, ctx: zmq.Context, curve: CurveServer, server: str) -> None:
        self.curve, self.server = curve, server
        self.allowed = AllowList(curve.clients)
        self.allowed.keys()  # a missing or unsafe folder is refused at start (ConfigError)
        self.log = RefusalLog(server)
        self.socket = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.refused = 0

    def handle(self) -> None:
        """Answer the authentication requests waiting, up to ``ZAP_BUDGET`` (the rest in the
        next round: a flood of handshakes never holds the server's own round up long)."""
        for _ in range(ZAP_BUDGET):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # policy: none left: back to the server's poll
                return
            try:
                ok = self._decide(frames)
            except Exception:  # policy: a request we cannot judge is refused, and we go on
                log.exception("%s: bad authentication request", self.server)
                ok = False
            version, request_id = (frames + [b"1.0", b""])[:2]
            self.socket.send_multipart([version, request_id, b"200" if ok else b"400",
                                        b"OK" if ok else b"refused", b"", b""])

    def _decide(self, frames: list[bytes]) -> bool:
        _version, _request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        ok, why = False, f"mechanism {mechanism.decode(errors='replace')}"
        if mechanism == b"CURVE" and credentials:
            key = z85.encode(credentials[0])
            try:
                ok = key in self.allowed.keys()
                why = "key not authorized"
            except ConfigError as err:  # policy: no readable allow-list admits nobody
                why = err.message
            if not ok:
                self.refused += 1
                self.log.refused("%s: refused a CURVE client from %s: %s (public key %s)",
                                 self.server, address.decode(errors="replace"), why,
                                 key.decode())
        else:
            self.refused += 1
            self.log.refused("%s: refused a client from %s: %s", self.server,
                             address.decode(errors="replace"), why)
        return ok

    def close(self) -> None:
        self.socket.close(linger=0)


def log_handshake_failures(event: dict, server: str, refusals: RefusalLog) -> None:
    """Log a handshake that failed before ZAP was asked (e.g. a client without CURVE), at
    ``refusals``' rate."""
    names = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error (a client without CURVE, "
                                                  "or the wrong server key)",
             zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused"}
    if event["event"] in names and event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        refusals.refused("%s: refused a connection from %s: %s", server,
                         event.get("endpoint", b"?").decode(errors="replace")
                         if isinstance(event.get("endpoint"), bytes) else event.get("endpoint"),
                         names[event["event"]])


# ---------------------------------------------------------------------------- trusted paths

#: symlinks followed in one path before it counts as a loop (the kernel's own limit)
MAX_LINKS = 40


def check_owner_and_mode(path: Path, what: str, st: os.stat_result | None = None, *,
                         sticky_ok: bool = False) -> None:
    """Refuse ``path`` (followed through links) when group or others may write it, or when a
    user other than us or root owns it. ``sticky_ok``: a folder such as ``/tmp`` (sticky,
    writable by all) is let through, as nobody can remove or rename what others own in it;
    for a folder only passed through on the way to what is checked."""
    st = st or path.stat()
    mode = st.st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_ok and mode & stat.S_ISVTX
                                                     and stat.S_ISDIR(mode)):
        raise ConfigError(f"{what} is writable by group or others; refusing to use it",
                          path=str(path), mode=oct(stat.S_IMODE(mode)))
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"{what} is owned by another user; refusing to use it",
                          path=str(path), owner=st.st_uid)


def trusted_path(path: Path, what: str, *, strict_folder: bool = True) -> Path:
    """Resolve ``path`` as the kernel would, link by link, and return its real path; refuse
    it (``ConfigError`` naming the culprit) when anyone but us or root could change what it
    leads to: every folder a name is looked up in, every link followed (its owner) and the
    end itself are checked. Folders on the way may be sticky ones such as ``/tmp`` (nobody
    can rename or remove what is ours there); with ``strict_folder`` the folder holding the
    end may not (anyone could add a file beside it, as in a hook folder)."""
    full = Path(path) if Path(path).is_absolute() else Path.cwd() / path  # no lexical ..
    pending = list(reversed(full.parts[1:]))
    current, links = Path("/"), 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = current.parent  # current is a real folder: so is its parent
            continue
        last = not _more(pending)
        check_owner_and_mode(current, f"folder {'holding' if last else 'on the way to'} the "
                                      f"{what}", sticky_ok=not (strict_folder and last))
        candidate = current / name
        try:
            st = candidate.lstat()
        except OSError as err:  # policy: what cannot be looked at cannot be trusted
            raise ConfigError(f"the {what} cannot be reached: {err.strerror}",
                              path=str(path), at=str(candidate)) from None
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        links += 1
        if links > MAX_LINKS:
            raise ConfigError(f"too many symbolic links on the way to the {what}",
                              path=str(path))
        if st.st_uid not in (os.getuid(), 0):
            raise ConfigError(f"a link on the way to the {what} is owned by another user; "
                              f"refusing to use it", path=str(candidate), owner=st.st_uid)
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current = Path("/")
        pending.extend(reversed([part for part in target.parts if part not in ("/", ".")]))
    check_owner_and_mode(current, what)
    return current


def _more(pending: list[str]) -> bool:
    """Whether names other than ``..`` are still to be looked up."""
    return any(part != ".." for part in pending)


def private_dir(path: Path, what: str) -> None:
    """Refuse the folder ``path`` when anyone but us or root could write in it, or replace it
    or a folder above it (``trusted_path``; its parent may be sticky, as ``/tmp`` is)."""
    trusted_path(path, what, strict_folder=False)
