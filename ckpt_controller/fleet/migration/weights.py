"""The weight files a level-2 migration leaves behind: checked on both nodes before the dump.

At level 2 the source drops the engine's weights before the dump, so the image holds none, and
the target's re-wake reads them back from the file the engine registered them from
(``StatusReply.reload_files``, published in the engine's record and copied into the
migration's). The target must read there byte for byte what the source's engine holds, or the
re-wake fails its bit-exact check after the engine was already stopped. So, before anything
happens to the engine: the target's ``receive`` reads each file and gives its digest
(``read_all``, ``chunked_sha256``: a file it cannot read fails the receive, and the
migration stays), and the source's ``send`` compares them with its own (``compare``: a
difference fails the send before the prepare, and the migration stays). Digests are kept per
file while its device, inode, size, modification and change times stay (``digest``), so a
second migration does not read it again, and a node digests the files of its engines in the
background as it first publishes them (``warm``), so a source's send finds its own ready;
with ``[migration] digest_ahead``, also the files of the fleet's other engines that it holds
at the same path (``Ahead``), so a target's receive finds its own ready too. A
node keeps them in its state dir too (``remember_in``, ``weight-digests.json``): after a
restart it reads none of those files again (for a model of hundreds of GiB, minutes of disk
and CPU at every start).
Neighbours: ``steps`` (receive, send), ``node`` (``warm``, ``Ahead``, ``remember_in``),
``records`` (``Migration.reload_files``, ``EngineRecord.reload_files``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_controller.errors import OperationError
from ckpt_controller.vocab import ReleaseLevel

log = logging.getLogger("ckpt_controller.fleet")

#: a file this large is said in the log before it is read (seconds of reading)
SAY_ABOVE_BYTES = 1 << 30
#: the pieces hashed side by side (``chunked_sha256``), and each read's size
CHUNK_BYTES = 64 << 20
READ_BYTES = 1 << 20

#: the file in a node's state dir that keeps the digests across restarts (``remember_in``)
DIGESTS_FILE = "weight-digests.json"
#: at most this many bytes of it are read, and at most this many files kept in it
DIGESTS_MAX_BYTES = 8 << 20
DIGESTS_MAX_FILES = 10_000
#: ``[migration] digest_ahead`` (``Ahead``): how often a node looks for the fleet's weight
#: files, and how many it digests ahead at most (a tenth of what the table keeps)
AHEAD_EVERY_S = 2.0
AHEAD_MAX_FILES = 1_000
#: ``Ahead`` reads every record again this often (a deleted one is seen only so); a file
#: modified less than ``AHEAD_SETTLED_S`` ago (being copied in) waits; one it could not read
#: is tried again ``AHEAD_RETRY_S`` later
AHEAD_FULL_EVERY_S = 300.0
AHEAD_SETTLED_S = 10.0
AHEAD_RETRY_S = 60.0

_lock = threading.Lock()
#: path -> ((device, inode, size, mtime_ns, ctime_ns), sha256 hex)
_known: dict[str, tuple[tuple[int, ...], str]] = {}
#: paths ``warm`` is digesting now
_warming: set[str] = set()
#: ``Ahead``'s paths whose digest failed -> when (tried again ``AHEAD_RETRY_S`` later)
_failed: dict[str, float] = {}
#: where ``_known`` is kept (``remember_in``); None: in memory only
_store: Path | None = None


def digest(path: str) -> str:
    """``chunked_sha256`` of ``path`` (hex), read again only when the file changed.
    ``OSError`` when it cannot be read; ``OperationError`` when it is no regular file
    (opened without blocking: a FIFO never wedges the step). A migration's step does not
    wait for ``warm``'s digest of the same file, made at a low priority: it reads the file
    itself."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OperationError(f"{path} is not a regular file", path=path)
        key = _key(st)
        with _lock:
            known = _known.get(path)
        if known is not None and known[0] == key:
            return known[1]
        if st.st_size > SAY_ABOVE_BYTES:
            log.info("fleet: reading %s (%.1f GiB) for its checksum", path, st.st_size / 2**30)
        value = chunked_sha256(f.fileno(), st.st_size)
    with _lock:
        _known[path] = (key, value)
        if _store is not None:
            _save(_store)
    return value


def _key(st: os.stat_result) -> tuple[int, ...]:
    """What says a file is the one digested: a write changes its times, a new file its
    inode; the change time cannot be set back by hand."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def remember_in(state_dir: Path) -> None:
    """Keep the digests in ``<state_dir>/weight-digests.json`` as well, and take the ones
    it holds (each used only while its file is still the same: ``_key``). A file that is not
    such a table is said in the log and written afresh: a cache, never a reason for a node
    not to start. Temporaries that an earlier process killed while saving left (``_save``:
    ``.weight-digests.json.<pid>``) are removed: the state dir is this node's alone."""
    global _store
    path = Path(state_dir) / DIGESTS_FILE
    for left in Path(state_dir).glob(f".{DIGESTS_FILE}.*"):
        if re.fullmatch(rf"\.{re.escape(DIGESTS_FILE)}\.\d+", left.name) \
                and left.name != f".{DIGESTS_FILE}.{os.getpid()}":
            try:
                left.unlink(missing_ok=True)
            except OSError as err:  # policy: a leftover, never a reason not to start
                log.warning("fleet: could not remove %s: %s", left, err)
    found = _load(path)
    with _lock:
        _store = path
        for name, entry in found.items():
            _known.setdefault(name, entry)


def _load(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from ckpt_controller import files

    try:
        doc = json.loads(files.read_small(path, DIGESTS_MAX_BYTES))
        entries = doc.get("files") if isinstance(doc, dict) and doc.get("version") == 1 \
            else None
        if not isinstance(entries, dict):
            raise ValueError("no version 1 table of files")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError, files.UnfitFileError) as err:
        # policy: a damaged cache: the files are read again as needed, the table made anew
        log.warning("fleet: %s is not a table of weight digests (%s); the weight files are "
                    "read again as needed, and it is written afresh", path, err)
        return {}
    out = {}
    for name, entry in list(entries.items())[:DIGESTS_MAX_FILES]:
        key = entry.get("stat") if isinstance(entry, dict) else None
        value = entry.get("sha256") if isinstance(entry, dict) else None
        if (isinstance(key, list) and len(key) == 5 and all(type(k) is int for k in key)
                and isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            out[name] = (tuple(key), value)
    return out


def _save(path: Path) -> None:
    """``_known`` written whole to a temporary name, then renamed over ``path`` (a reader
    sees the old table or the new). Called under ``_lock``; a failure is said, not raised:
    the digest was made, only not kept."""
    kept = dict(list(_known.items())[-DIGESTS_MAX_FILES:])
    doc = {"version": 1, "files": {name: {"stat": list(key), "sha256": value}
                                   for name, (key, value) in kept.items()}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # one a killed process of this pid left
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as err:  # policy: kept in memory; the next digest tries again
        log.warning("fleet: could not keep the weight digests in %s: %s", path, err)
        tmp.unlink(missing_ok=True)


def chunked_sha256(fd: int, size: int) -> str:
    """The SHA-256 of the SHA-256s of the file's ``CHUNK_BYTES`` pieces, in order, and its
    size: each piece read and hashed on a thread of its own (hashing gives up the GIL), so a
    file of tens of GiB takes its size over this host's cores, not over one."""
    pieces = max(1, -(-size // CHUNK_BYTES))

    def piece(i: int) -> bytes:
        h, at, end = hashlib.sha256(), i * CHUNK_BYTES, min(size, (i + 1) * CHUNK_BYTES)
        while at < end:
            buf = os.pread(fd, min(READ_BYTES, end - at), at)
            if not buf:
                raise OSError(f"the file ended at {at} bytes while read ({size} expected)")
            h.update(buf)
            at += len(buf)
        return h.digest()

    with ThreadPoolExecutor(max_workers=min(pieces, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(piece, range(pieces)))
    return hashlib.sha256(b"".join(digests) + size.to_bytes(8, "little")).hexdigest()


def warm(paths, recheck: bool = False) -> None:
    """Digest ``paths`` on a thread of its own at a low priority, those not known yet: a node
    does so for the files its engines re-wake from as it first publishes them, so that a
    migration's send finds the source's digests ready (0.2 s of its own here, with the
    engine generating on both cores, for the small reference model's 264 MiB).
    ``recheck`` (``Ahead``): also those whose kept digest is of an older version of
    the file; a path that is not a regular file here is left alone."""
    stale = [p for p in paths if p not in _warming and _stale(p, recheck)]  # stats: unlocked
    with _lock:  # the node's thread and ``Ahead``'s: each path digested by one of them
        todo = [p for p in stale if p not in _warming]
        _warming.update(todo)
    if not todo:
        return

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:  # policy: at the usual priority, then
            pass
        for path in todo:
            try:
                digest(path)
                _failed.pop(path, None)
            except (OSError, OperationError) as err:  # policy: the migration says it
                log.debug("fleet: no digest of %s ahead of a migration: %s", path, err)
                _failed[path] = time.monotonic()
            finally:
                _warming.discard(path)

    threading.Thread(target=run, name="weights-digest", daemon=True).start()


def _stale(path: str, recheck: bool) -> bool:
    """Whether ``warm`` digests ``path``: none kept (``recheck``: or one of another version
    of the file, and the file is here: an absolute path to a regular file, none of the
    kernel's, whatever another node's record names; not modified in the last
    ``AHEAD_SETTLED_S``, nor failed in the last ``AHEAD_RETRY_S``)."""
    known = _known.get(path)
    if not recheck:
        return known is None
    if time.monotonic() - _failed.get(path, -AHEAD_RETRY_S) < AHEAD_RETRY_S:
        return False
    try:
        if not os.path.isabs(path) or os.path.realpath(path).startswith(_KERNELS):
            return False
        st = os.stat(path)
    except (OSError, ValueError):  # policy: not here (or no path): nothing to digest ahead
        return False
    return (stat.S_ISREG(st.st_mode) and (known is None or known[0] != _key(st))
            and time.time() - st.st_mtime >= AHEAD_SETTLED_S)


#: where no model file lives (``/proc/kcore`` is a regular file of the machine's memory)
_KERNELS = ("/proc/", "/sys/", "/dev/")


class Ahead:
    """``[migration] digest_ahead``: the files the fleet's engines on other nodes re-wake
    from (their records' ``reload_files``), digested by ``warm`` where this node holds them
    at the same path, so that a level-2 move here reads none of them in its receive. Each
    ``look`` reads the records written since the last (``Etcd.changed_since``; all of them
    every ``AHEAD_FULL_EVERY_S``, or when etcd's revision went back, so a deleted record's
    files are let go) and looks at each file's ``stat`` again (a new version of a model at
    the same path is read again). At most ``AHEAD_MAX_FILES`` files, the first by name
    (more is said once); a record it cannot read is left out (``fleet status`` lists it).
    The node runs it on a thread of its own (``run``)."""

    def __init__(self, etcd, keys, node: str) -> None:
        self.etcd, self.keys, self.node = etcd, keys, node
        self.revision = 0
        self._full_at = 0.0  # when all records are next read again
        self.named: dict[str, tuple[str, ...]] = {}  # record key -> the files it names
        self.files: list[str] = []
        self._said_capped = False

    def run(self, stop: threading.Event) -> None:
        """``look`` every ``AHEAD_EVERY_S`` until ``stop``, on the caller's thread (the
        node's thread of its own)."""
        from ckpt_controller.errors import CkptError

        while not stop.is_set():
            try:
                self.look()
            except CkptError as err:  # policy: etcd away: the fleet's thread says so
                log.debug("fleet: no look at the fleet's weight files: %s", err)
            except Exception:  # policy: a bug here must not end the looks for good
                log.exception("fleet: looking at the fleet's weight files failed")
            stop.wait(AHEAD_EVERY_S)

    def look(self) -> None:
        from ckpt_controller.errors import DamagedRecordError
        from ckpt_controller.fleet import records

        full = time.monotonic() >= self._full_at
        kvs, revision = self.etcd.changed_since(self.keys.engines,
                                                0 if full else self.revision)
        if revision < self.revision and not full:  # etcd made anew, or restored: all again
            full = True
            kvs, revision = self.etcd.changed_since(self.keys.engines, 0)
        named = {} if full else dict(self.named)
        for kv in kvs:
            try:
                rec = records.decode(records.EngineRecord, kv.value, kv.key)
            except DamagedRecordError:  # policy: not this node's to say; ``fleet status`` is
                named.pop(kv.key, None)
                continue
            named[kv.key] = tuple(rec.reload_files.values()) if rec.node != self.node else ()
        files = sorted({path for paths in named.values() for path in paths})
        if len(files) > AHEAD_MAX_FILES and not self._said_capped:
            log.warning("fleet: the fleet's engines re-wake from %d files; digest_ahead "
                        "digests the first %d by name", len(files), AHEAD_MAX_FILES)
            self._said_capped = True
        self.named, self.revision, self.files = named, revision, files[:AHEAD_MAX_FILES]
        if full:
            self._full_at = time.monotonic() + AHEAD_FULL_EVERY_S
        warm(self.files, recheck=True)


def read_all(files: dict[str, str], node: str, engine: str) -> dict[str, str]:
    """Path -> digest of each file in ``files`` (tag -> path), as this node reads it; an
    ``OperationError`` naming the first it cannot read. ``lines`` writes it as a step's
    detail."""
    out = {}
    for tag, path in sorted(files.items()):
        try:
            out[path] = digest(path)
        except (OSError, OperationError) as err:
            why = err.message if isinstance(err, OperationError) else (
                err.strerror or str(err))
            raise OperationError(
                f"{node} cannot read {path}, the file {engine} re-wakes its {tag} from after "
                f"a level-2 move: {why}; give {node} the same file at that path, or migrate "
                "with --level 0", node=node, path=path, tag=tag) from None
    return out


def lines(digests: dict[str, str]) -> list[str]:
    """``read_all``'s answer as a step's detail: ``<hex>  <path>`` per file."""
    return [f"{value}  {path}" for path, value in sorted(digests.items())]


def compare(files: dict[str, str], theirs: list, node: str, target: str,
            engine: str) -> None:
    """The target's digests (``theirs``, its ``lines``) against this node's of the same
    files: an ``OperationError`` naming the first file that differs or that the target did
    not read."""
    said = {str(line)[66:]: str(line)[:64] for line in theirs}
    mine = read_all(files, node, engine)
    for path, value in mine.items():
        there = said.get(path)
        if there != value:
            said = f"sha256 {str(there)[:12]}" if there else "not read there"
            raise OperationError(
                f"{path} differs on {target} ({said}) from {node}'s (sha256 {value[:12]}): "
                f"after a level-2 move {engine} would re-wake other weights there; put the "
                f"same file on {target}, or migrate with --level 0", path=path,
                node=node, target=target)


def reloads(level) -> bool:
    """Whether a prepare at ``level`` drops weights that the re-wake reads from their file."""
    return level == ReleaseLevel.DISCARD  # a damaged record's odd value: not 2
