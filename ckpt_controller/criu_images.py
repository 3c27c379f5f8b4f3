"""What Python needs around CRIU image folders when an engine moves between nodes.

- ``pages_expected(folder)``: each ``pages-N.img``'s size as the folder's pagemap images
  promise it. A dump through a page server leaves its pages (and their pagemaps) on the
  target, outside ``criu-manifest``; ``check(folder)`` holds them to these sizes, so a pages
  file cut short is refused before ``criu restore`` (which would hang on it) runs.
  ``python -m ckpt_controller.criu_images check DIR`` is the same check for the
  ``criu-restore`` hook (stdlib only: any Python 3.11 runs it with the project on
  ``PYTHONPATH``).
- ``pack_small(folder)`` / ``unpack_small(data, folder)``: an image's non-page files as one
  gzip'd tar archive, for shipping through etcd (bounds: ``MAX_SMALL_FILES`` files,
  ``MAX_SMALL_BYTES`` in all, before compression).
- ``PageServer``: ``criu page-server`` receiving one dump's pages into a folder.
- ``image_bytes(folder)``: the size of an image on disk (the controller's ``ckpt_image_bytes``
  gauge, a drill's report); ``read_stats``: CRIU's own dump and restore statistics.

CRIU's image format (read from CRIU's images/pagemap.proto, criu/include/magic.h and
criu/pagemap.c; our own reader): a file starts with two u32 magics (IMG_COMMON_MAGIC, then
the image's own), then entries, each a u32 length and a protobuf message of that length. A
pagemap image holds one ``pagemap_head {pages_id = 1}`` then ``pagemap_entry {vaddr = 1,
compat_nr_pages = 2, in_parent = 3, flags = 4, nr_pages = 5}`` entries; an entry's pages are
in ``pages-<pages_id>.img`` when its flags have PE_PRESENT (an entry without flags: present
unless ``in_parent``), one page each, in entry order; PE_PARENT and lazy-only entries hold
none there. Pages files are raw (no magic).

Neighbours: ``errors`` (``ImageError``); ``hooks/criu-dump`` (``CKPT_PAGE_SERVER``) and
``hooks/criu-restore`` (runs ``check``); the fleet's migration phases use the rest;
``controller.metrics`` and ``drill.runner`` measure images with ``image_bytes``.
"""

from __future__ import annotations

import io
import os
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from ckpt_controller.errors import DeadlineError, ImageError, OperationError, UsageError

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

#: a pagemap entry larger than this is no pagemap entry (they are 8 to about 30 bytes)
_MAX_ENTRY = 4096
#: pack_small's bounds, before compression: a migrated engine's non-page files are tens of
#: KiB (ghost files of deleted-but-open files, up to --ghost-limit each, are the big ones)
MAX_SMALL_FILES = 10_000
MAX_SMALL_BYTES = 256 * 2**20
#: the file criu-dump writes beside the manifest when the pages went to a page server
PAGES_REMOTE = "criu-pages-remote"
_PAGES = re.compile(r"pages-\d+\.img")
_PAGEMAP = re.compile(r"pagemap-(?:shmem-)?\d+\.img")


# ------------------------------------------------------------------ pagemaps and pages sizes

def _varint(buf: bytes, at: int, where: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ImageError(f"{where}: a protobuf varint runs past its entry", file=where)
        byte = buf[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(msg: bytes, where: str) -> dict[int, int]:
    """The varint fields of one protobuf message (the last of a repeated number wins);
    fields of other wire types are skipped."""
    out, at = {}, 0
    while at < len(msg):
        key, at = _varint(msg, at, where)
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number], at = _varint(msg, at, where)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            size, at = _varint(msg, at, where)
            at += size
        else:
            raise ImageError(f"{where}: protobuf wire type {wire} in a pagemap", file=where)
        if at > len(msg):
            raise ImageError(f"{where}: a protobuf field runs past its entry", file=where)
    return out


def read_pagemap(path: Path) -> tuple[int, int]:
    """(pages_id, bytes of pages it puts in ``pages-<pages_id>.img``) of one pagemap image;
    ``ImageError`` naming the file when it is not a whole pagemap image."""
    where = path.name
    data = path.read_bytes()
    if len(data) < 8:
        raise ImageError(f"{where}: {len(data)} bytes, shorter than an image's magic",
                         file=where)
    common, magic = struct.unpack_from("<II", data)
    if common != IMG_COMMON_MAGIC or magic != PAGEMAP_MAGIC:
        raise ImageError(f"{where}: not a pagemap image (magic {common:#x} {magic:#x})",
                         file=where)
    at, head, pages = 8, None, 0
    while at < len(data):
        if at + 4 > len(data):
            raise ImageError(f"{where}: cut short inside an entry's length", file=where)
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        if size > _MAX_ENTRY or at + size > len(data):
            raise ImageError(f"{where}: an entry of {size} bytes at offset {at - 4} runs past "
                             f"the file ({len(data)} bytes)", file=where)
        fields = _fields(data[at:at + size], where)
        at += size
        if head is None:
            if 1 not in fields:
                raise ImageError(f"{where}: its head has no pages_id", file=where)
            head = fields[1]
            continue
        if 1 not in fields or 2 not in fields:
            raise ImageError(f"{where}: an entry without vaddr or nr_pages", file=where)
        nr = fields.get(5, fields[2])
        flags = fields.get(4)
        if flags is None:  # an older CRIU's entry (criu/pagemap.c, init_compat_pagemap_entry)
            flags = PE_PARENT if fields.get(3) else PE_PRESENT
        if flags & PE_PRESENT:
            pages += nr * PAGE_SIZE
    if head is None:
        raise ImageError(f"{where}: no pagemap head", file=where)
    return head, pages


def pages_expected(folder: Path | str) -> dict[str, int]:
    """Each ``pages-N.img`` the pagemap images of ``folder`` point at, with the bytes they
    promise it (the pages present in this image, not those in a parent image or lazy)."""
    folder = Path(folder)
    out: dict[str, int] = {}
    for path in sorted(folder.iterdir()):
        if _PAGEMAP.fullmatch(path.name):
            pages_id, size = read_pagemap(path)
            name = f"pages-{pages_id}.img"
            out[name] = out.get(name, 0) + size
    return out


def check(folder: Path | str) -> dict[str, int]:
    """The pages files of ``folder`` against ``pages_expected``: each there, with exactly the
    promised size; and a pagemap for each process (``mm-N.img``). Returns the sizes;
    ``ImageError`` naming the first file that is missing, cut short or too long."""
    folder = Path(folder)
    for mm in sorted(folder.glob("mm-*.img")):
        pagemap = f"pagemap-{mm.name[3:]}"
        if not (folder / pagemap).is_file():
            raise ImageError(f"{pagemap}: missing ({mm.name} has no pagemap)", file=pagemap)
    expected = pages_expected(folder)
    for name, size in expected.items():
        path = folder / name
        if not path.is_file():
            raise ImageError(f"{name}: missing ({size} bytes expected)", file=name)
        got = path.stat().st_size
        if got != size:
            raise ImageError(f"{name}: {got} bytes, its pagemap promises {size}", file=name,
                             size=got, expected=size)
    return expected


# ------------------------------------------------------------------ the small files as one archive

def _small_files(folder: Path) -> list[Path]:
    """The files ``pack_small`` ships: everything but pages files, logs and dot files."""
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or path.name.endswith(".log"):
            continue
        if _PAGES.fullmatch(path.name) and len(rel.parts) == 1:
            continue
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise ImageError(f"{rel}: not a plain file or folder; an image holds none",
                             file=str(rel))
        if path.is_file():
            out.append(path)
    return out


def pack_small(folder: Path | str) -> bytes:
    """The non-page files of the image in ``folder`` (all but ``pages-*.img``, ``*.log`` and
    dot files) as a gzip'd tar, paths relative to ``folder``; ``ImageError`` past
    ``MAX_SMALL_FILES`` or ``MAX_SMALL_BYTES``."""
    folder = Path(folder)
    files = _small_files(folder)
    total = sum(f.stat().st_size for f in files)
    if len(files) > MAX_SMALL_FILES or total > MAX_SMALL_BYTES:
        raise ImageError(f"the image in {folder} has {len(files)} non-page files of {total} "
                         f"bytes; at most {MAX_SMALL_FILES} and {MAX_SMALL_BYTES} ship",
                         folder=str(folder))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for path in files:
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def _member_name(member: tarfile.TarInfo) -> str:
    name = member.name
    parts = Path(name).parts
    if (not member.isfile() or name.startswith("/") or not parts or ".." in parts
            or any(part.startswith(".") for part in parts) or _PAGES.fullmatch(name)):
        raise ImageError(f"{name!r}: not a member an image's small files may have (only "
                         "plain files, relative, no '..', no pages files)", member=name)
    return name


def unpack_small(data: bytes, folder: Path | str) -> list[str]:
    """Write what ``pack_small`` made into ``folder`` (made 0700 if missing); returns the
    names written. Every member is checked before one is written: plain files only, no
    absolute path, no ``..``, no pages file, within the bounds; a file already there with
    other bytes is refused (the same bytes again are fine: a repeated adopt)."""
    folder = Path(folder)
    if len(data) > MAX_SMALL_BYTES:
        raise ImageError(f"an archive of {len(data)} bytes; at most {MAX_SMALL_BYTES}")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = tar.getmembers()
            names = [_member_name(m) for m in members]
            total = sum(m.size for m in members)
            if len(members) > MAX_SMALL_FILES or total > MAX_SMALL_BYTES:
                raise ImageError(f"an archive of {len(members)} files, {total} bytes; at "
                                 f"most {MAX_SMALL_FILES} and {MAX_SMALL_BYTES}")
            contents = [tar.extractfile(m).read() for m in members]
    except (tarfile.TarError, EOFError, OSError) as exc:  # policy: unreadable is damaged
        raise ImageError(f"the image's small files do not unpack: {exc}") from None
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, content in zip(names, contents):
        path = folder / name
        if path.is_symlink() or (path.exists() and path.read_bytes() != content):
            raise ImageError(f"{path} already exists with other content; not replacing it",
                             file=str(path))
    for name, content in zip(names, contents):
        path = folder / name
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.replace(tmp, path)
    return names


# ------------------------------------------------------------------ the page server

def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def criu_error(log_text: str) -> str | None:
    """CRIU's first error in ``log_text`` (its log): the words an operator needs, e.g.
    ``Error (criu/util.c:1239): Can't bind page server: Address already in use``, without
    the timestamp before them; None when it has none."""
    for line in log_text.splitlines():
        at = line.find("Error (")
        if at >= 0:
            return line[at:].strip()[:500]
    return None


class PageServer:
    """``criu page-server -D folder --address address --port port``, for one dump: started
    here, ready once it listens (CRIU's ``--status-fd`` byte), ending by itself once the dump
    it served ended. ``port=0``: a free port is chosen (here, where the controller runs; in
    a network namespace of its own through ``wrap`` it may be taken there, and another is
    tried, up to ``tries`` times). ``wrap`` goes before criu (``["nsenter",
    "--net=/run/netns/B"]``: it must exec criu). Its log: ``<folder>/page-server.log``.
    ``OperationError`` when it does not start, with the log's tail."""

    LOG = "page-server.log"
    #: its PID, while it runs: a controller killed during a migration leaves it, and the next
    #: one ends it at start (``reap_page_servers``)
    PIDFILE = "page-server.pid"

    def __init__(self, criu: str | Path, folder: Path | str, address: str, port: int = 0, *,
                 wrap: list[str] | tuple[str, ...] = (), tries: int = 5,
                 timeout_s: float = 30.0) -> None:
        if not 0 <= port <= 65535:
            raise UsageError(f"page server port {port}: not 0 to 65535", port=port)
        self.folder = Path(folder).resolve()
        self.address = address
        self.proc: subprocess.Popen | None = None
        for _ in range(tries):
            self.port = port or _free_port(address)
            if self._start(str(criu), list(wrap), timeout_s):
                return
            if port:
                break
        tail = self.log_tail()
        said = criu_error(tail)
        raise OperationError(f"criu page-server did not start on {address}:{self.port}"
                             + (f": {said}" if said else " (its log says no error)"),
                             address=address, port=self.port, log_tail=tail)

    @property
    def endpoint(self) -> str:
        """``ADDR:PORT``, as criu-dump's ``CKPT_PAGE_SERVER`` takes it."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    def _start(self, criu: str, wrap: list[str], timeout_s: float) -> bool:
        """Start one page server; whether it listens (False: it ended, as on a port
        already taken)."""
        (self.folder / self.LOG).unlink(missing_ok=True)
        ready_r, ready_w = os.pipe()
        try:
            try:
                self.proc = subprocess.Popen(
                    [*wrap, criu, "page-server", "-D", str(self.folder), "--address",
                     self.address, "--port", str(self.port), "-o", self.LOG, "-v2",
                     "--status-fd", str(ready_w)],
                    pass_fds=(ready_w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)  # in the controller's process group: stopping
                # the group (systemd, a terminal's Ctrl-C) stops it too
            except OSError as exc:  # policy: no criu (or no wrapper) to run: say which, typed
                raise OperationError(f"cannot start criu page-server: {exc}",
                                     command=[*wrap, criu]) from None
            (self.folder / self.PIDFILE).write_text(f"{self.proc.pid}\n")
            os.close(ready_w)
            ready_w = -1
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise OperationError(f"criu page-server did not listen within "
                                         f"{timeout_s} s", log_tail=self.log_tail())
                readable, _, _ = select.select([ready_r], [], [], min(left, 0.5))
                if readable:
                    listening = os.read(ready_r, 1) != b""  # EOF: it ended before listening
                    if not listening:
                        self.proc.wait(timeout=10)
                    return listening
        finally:
            if ready_w >= 0:
                os.close(ready_w)
            os.close(ready_r)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.folder / self.LOG).read_text(errors="replace")
        except OSError:  # policy: no log yet: nothing to show
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(self, timeout_s: float) -> int:
        """Its exit status once it ended (after the dump it served); ``DeadlineError`` if it
        still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # policy: a deadline passed: say so, typed
            raise DeadlineError(f"criu page-server on {self.endpoint} still runs after "
                                f"{timeout_s} s", endpoint=self.endpoint) from None

    def stop(self, grace_s: float = 5.0) -> None:
        """End it (SIGTERM, ``grace_s``, SIGKILL) if it still runs."""
        (self.folder / self.PIDFILE).unlink(missing_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # policy: past its grace: kill it
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "PageServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """``check DIR``: exit 0 and one line of sizes, or exit 2 and the reason on stderr."""
    if len(argv) != 2 or argv[0] != "check":
        print("usage: python -m ckpt_controller.criu_images check DIR", file=sys.stderr)
        return 2
    try:
        sizes = check(argv[1])
    except (ImageError, OSError) as exc:  # policy: the hook reports it and refuses the image
        print(getattr(exc, "message", str(exc)), file=sys.stderr)
        return 2
    print(f"pages as their pagemaps promise: {sum(sizes.values())} bytes in "
          f"{len(sizes)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def criu_path() -> str:
    """The criu to run: ``$CKPT_CRIU``, else the one ``make criu`` installed next to this
    project (the shipped hooks look in the same places)."""
    root = Path(__file__).resolve().parents[1]
    return os.environ.get("CKPT_CRIU") or str(root / ".cache" / "criu" / "bin" / "criu")


# ---------------------------------------------------------------- statistics

def image_bytes(folder: Path | str) -> int:
    """The bytes of the regular files under ``folder``, at their apparent sizes (``st_size``,
    what copying the image moves), 0 when it is gone. Links are neither followed nor counted;
    a file or folder removed while we count is left out, never an error."""
    total = 0
    for root, _dirs, files in os.walk(folder):  # unreadable or vanished folders: skipped
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # policy: a file removed while we count is not counted
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


#: CRIU's stats images (stats-dump, stats-restore) start with these two magics
_IMG_SERVICE_MAGIC, _STATS_MAGIC = 0x55105940, 0x57093306


def read_stats(path: Path) -> dict[str, int]:
    """CRIU's ``stats-dump`` or ``stats-restore``: one ``stats_entry`` whose field 1 (dump)
    or 2 (restore) is a message of varints (CRIU's images/stats.proto); {} when absent."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    magic, kind, size = struct.unpack_from("<III", data)
    if (magic, kind) != (_IMG_SERVICE_MAGIC, _STATS_MAGIC):
        raise ImageError(f"{path.name}: not a CRIU stats image")
    msg, at = data[12:12 + size], 0
    while at < len(msg):
        key, at = _varint(msg, at, path.name)
        if key & 7 != 2:
            raise ImageError(f"{path.name}: unexpected field {key >> 3}")
        length, at = _varint(msg, at, path.name)
        names = DUMP_FIELDS if key >> 3 == 1 else RESTORE_FIELDS
        return {names[k]: v for k, v in _fields(msg[at:at + length], path.name).items()
                if k in names}
    return {}


DUMP_FIELDS = {1: "freezing_us", 2: "frozen_us", 3: "memdump_us", 4: "memwrite_us",
               5: "pages_scanned", 7: "pages_written"}
RESTORE_FIELDS = {3: "forking_us", 4: "restore_us", 5: "pages_restored"}


def reap_page_servers(image_dir: Path) -> list[int]:
    """End the page servers an earlier controller left running for migrations into
    ``image_dir`` (killed in the middle of one, it could not end them: they wait for a dump
    that never comes), and forget their PID files; the PIDs ended. A PID file whose process
    is gone, or is no page server of that folder now (the PID reused), is only removed."""
    ended = []
    for pidfile in sorted(Path(image_dir).glob(f"*/*/{PageServer.PIDFILE}")):
        folder = pidfile.parent.resolve()
        try:
            pid = int(pidfile.read_text().strip() or 0)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):  # policy: gone, or not a PID: nothing to end
            argv = []
        if b"page-server" in argv and os.fsencode(folder) in argv:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(pid)
            except ProcessLookupError:  # policy: it ended just now
                pass
        pidfile.unlink(missing_ok=True)
    return ended
