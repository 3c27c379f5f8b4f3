"""``criu_images`` without CRIU: pagemap images written here byte by byte (CRIU's format:
two magics, then u32-length-prefixed protobuf messages), the sizes they promise, damaged
ones refused with ``ImageError``; the small files' archive and what unpacking refuses; the
``check`` command as the criu-restore hook runs it (python3, the project on PYTHONPATH).
The real thing, with CRIU between two network namespaces: ``test_criu_between_nodes``."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest

from ckpt_controller import criu_images
from ckpt_controller.criu_images import (
    IMG_COMMON_MAGIC, PAGE_SIZE, PAGEMAP_MAGIC, check, pack_small, pages_expected,
    unpack_small)
from ckpt_controller.errors import ImageError
from support import ROOT
from support.timing import scaled, wait_until


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _msg(**fields: int) -> bytes:
    numbers = {"pages_id": 1, "vaddr": 1, "compat_nr_pages": 2, "in_parent": 3, "flags": 4,
               "nr_pages": 5}
    body = b"".join(_varint(numbers[k] << 3) + _varint(v) for k, v in fields.items())
    return struct.pack("<I", len(body)) + body


def _pagemap(pages_id: int, *entries: dict) -> bytes:
    return (struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + _msg(pages_id=pages_id)
            + b"".join(_msg(**e) for e in entries))


def _image(folder, pages_ok=True):
    """A pagemap for process 1 promising 5 pages in pages-7.img: 3 present, 2 present in an
    older CRIU's entry (no flags); the parent's, the lazy-only and an older CRIU's in_parent
    entry hold none there."""
    (folder / "mm-1.img").write_bytes(b"mm")
    (folder / "pagemap-1.img").write_bytes(_pagemap(
        7, dict(vaddr=0x10000, compat_nr_pages=3, flags=4, nr_pages=3),
        dict(vaddr=0x20000, compat_nr_pages=5, flags=1, nr_pages=5),
        dict(vaddr=0x30000, compat_nr_pages=4, flags=2, nr_pages=4),
        dict(vaddr=0x40000, compat_nr_pages=2),
        dict(vaddr=0x50000, compat_nr_pages=6, in_parent=1)))
    (folder / "pages-7.img").write_bytes(b"\0" * (5 * PAGE_SIZE if pages_ok else PAGE_SIZE))


def test_the_pages_a_pagemap_promises(tmp_path):
    _image(tmp_path)
    assert pages_expected(tmp_path) == {"pages-7.img": 5 * PAGE_SIZE}
    assert check(tmp_path) == {"pages-7.img": 5 * PAGE_SIZE}


@pytest.mark.parametrize("damage, named", [
    ("short", "pages-7.img: 4096 bytes, its pagemap promises 20480"),
    ("no pages", "pages-7.img: missing (20480 bytes expected)"),
    ("no pagemap", "pagemap-1.img: missing (mm-1.img has no pagemap)"),
    ("cut pagemap", "pagemap-1.img: an entry of"),
    ("magic", "pagemap-1.img: not a pagemap image"),
    ("no head", "pagemap-1.img: no pagemap head"),
])
def test_a_damaged_image_is_refused_naming_the_file(tmp_path, damage, named):
    _image(tmp_path, pages_ok=damage != "short")
    pagemap = tmp_path / "pagemap-1.img"
    if damage == "no pages":
        (tmp_path / "pages-7.img").unlink()
    elif damage == "no pagemap":
        pagemap.unlink()
    elif damage == "cut pagemap":
        pagemap.write_bytes(pagemap.read_bytes()[:-3])
    elif damage == "magic":
        pagemap.write_bytes(b"\1" * 4 + pagemap.read_bytes()[4:])
    elif damage == "no head":
        pagemap.write_bytes(pagemap.read_bytes()[:8])
    with pytest.raises(ImageError) as info:
        check(tmp_path)
    assert named in info.value.message
    assert info.value.exit_code == 2


def test_the_hooks_check_runs_on_plain_python3_with_the_project_on_its_path(tmp_path):
    """As criu-restore runs it: exit 0 and the sizes, or exit 2 and the file on stderr."""
    _image(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = ["python3", "-m", "ckpt_controller.criu_images", "check", str(tmp_path)]
    good = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(60), cwd="/")
    assert good.returncode == 0 and f"{5 * PAGE_SIZE} bytes in 1 files" in good.stdout
    os.truncate(tmp_path / "pages-7.img", PAGE_SIZE)
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(60), cwd="/")
    assert bad.returncode == 2 and bad.stderr.startswith("pages-7.img: 4096 bytes")


def test_small_files_travel_as_one_archive_without_pages_or_logs(tmp_path):
    here, there = tmp_path / "a", tmp_path / "b"
    here.mkdir()
    _image(here)
    (here / "dump.log").write_text("log")
    (here / ".hook-dump-1.pid").write_text("1")
    (here / "criu-manifest").write_text("1 2 ./mm-1.img\n")
    (here / "link-remap").mkdir()
    (here / "link-remap" / "%dev%shm%link_remap.3").write_bytes(b"sem")
    data = pack_small(here)
    names = unpack_small(data, there)
    assert sorted(names) == ["criu-manifest", "link-remap/%dev%shm%link_remap.3", "mm-1.img",
                             "pagemap-1.img"]
    assert (there / "pagemap-1.img").read_bytes() == (here / "pagemap-1.img").read_bytes()
    assert oct((there / "link-remap").stat().st_mode & 0o777) == "0o700"
    assert unpack_small(data, there) == names  # the same again (a repeated adopt) is fine
    (there / "mm-1.img").write_bytes(b"other")
    with pytest.raises(ImageError, match="already exists with other content"):
        unpack_small(data, there)


def _tar(*members: tuple[str, bytes, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, content in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


@pytest.mark.parametrize("name, kind", [
    ("../escape.img", tarfile.REGTYPE), ("/etc/escape.img", tarfile.REGTYPE),
    ("link-remap/../../x", tarfile.REGTYPE), ("core-1.img", tarfile.SYMTYPE),
    ("pages-1.img", tarfile.REGTYPE), (".hidden", tarfile.REGTYPE),
])
def test_unpacking_refuses_members_an_image_has_not(tmp_path, name, kind):
    with pytest.raises(ImageError) as info:
        unpack_small(_tar(("core-1.img", tarfile.REGTYPE, b"ok"), (name, kind, b"x")),
                     tmp_path / "b")
    assert repr(name) in info.value.message
    assert not (tmp_path / "b").exists()  # checked whole before anything is written


def test_the_archive_is_bounded_and_garbage_is_refused(tmp_path, monkeypatch):
    (tmp_path / "core-1.img").write_bytes(b"x" * 2000)
    monkeypatch.setattr(criu_images, "MAX_SMALL_BYTES", 1999)
    with pytest.raises(ImageError, match="1 non-page files of 2000 bytes; at most"):
        pack_small(tmp_path)
    monkeypatch.setattr(criu_images, "MAX_SMALL_BYTES", 2000)
    data = pack_small(tmp_path)
    assert len(data) < 1999  # compressed
    monkeypatch.setattr(criu_images, "MAX_SMALL_BYTES", 1999)
    with pytest.raises(ImageError, match="an archive of 1 files, 2000 bytes"):
        unpack_small(data, tmp_path / "b")
    monkeypatch.setattr(criu_images, "MAX_SMALL_BYTES", len(data) - 1)
    with pytest.raises(ImageError, match=f"an archive of {len(data)} bytes"):
        unpack_small(data, tmp_path / "b")
    monkeypatch.undo()
    with pytest.raises(ImageError, match="do not unpack"):
        unpack_small(b"not a tar", tmp_path / "b")


def test_a_page_server_without_criu_is_a_typed_error(tmp_path):
    from ckpt_controller.criu_images import PageServer
    from ckpt_controller.errors import OperationError

    with pytest.raises(OperationError, match="cannot start criu page-server"):
        PageServer(tmp_path / "no-criu", tmp_path, "127.0.0.1", 4711)


def test_a_page_server_that_does_not_start_says_criu_s_words(tmp_path):
    """A bad address or a port already taken: the error names CRIU's own first error (it
    reached the operator as "did not start on ADDR:PORT" only, the why in a log file)."""
    import socket

    from ckpt_controller.criu_images import PageServer
    from ckpt_controller.errors import OperationError
    from support.criu import CRIU, criu_missing, required

    reason = required(criu_missing(), "the page server test")
    if reason is not None:
        pytest.skip(reason)
    with pytest.raises(OperationError, match=r"did not start on 256\.1\.1\.1:4711: Error "
                                             r"\(.*\): Invalid server address"):
        PageServer(CRIU, tmp_path, "256.1.1.1", 4711)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OperationError, match="Address already in use"):
            PageServer(CRIU, tmp_path, "127.0.0.1", port)


def test_criu_error_is_the_first_error_line_without_its_timestamp():
    log = ("(00.000010) Version: 4.2\n(00.000400) Error (criu/util.c:1239): Can't bind page "
           "server: Address already in use\n(00.000500) Error (criu/x.c:1): later\n")
    assert criu_images.criu_error(log) == ("Error (criu/util.c:1239): Can't bind page "
                                           "server: Address already in use")
    assert criu_images.criu_error("(00.1) Warn: nothing wrong\n") is None


def test_image_bytes_counts_regular_files_at_their_apparent_size(tmp_path):
    from ckpt_controller.criu_images import image_bytes

    image = tmp_path / "image"
    (image / "sub").mkdir(parents=True)
    (image / "core-1.img").write_bytes(b"x" * 1000)
    (image / "sub" / "pages-1.img").write_bytes(b"y" * 24)
    with (image / "sparse.img").open("wb") as f:
        f.truncate(1 << 20)  # a hole: 1 MiB apparent, next to nothing in blocks
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"z" * 5000)
    (image / "to-file").symlink_to(outside / "big")  # links: neither followed nor counted
    (image / "to-folder").symlink_to(outside)
    (image / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(image / "fifo")  # not a regular file
    assert image_bytes(image) == 1000 + 24 + (1 << 20)
    assert image_bytes(str(image)) == image_bytes(image)
    assert image_bytes(tmp_path / "gone") == 0


def test_image_bytes_leaves_out_a_file_removed_while_it_counts(tmp_path, monkeypatch):
    """A file listed, then removed before its size is read (a capture cleaning up beside
    the gauge), is not counted and is no error."""
    from ckpt_controller.criu_images import image_bytes

    (tmp_path / "stays.img").write_bytes(b"x" * 10)
    (tmp_path / "goes.img").write_bytes(b"x" * 99)
    real_lstat = os.lstat

    def lstat_after_removal(path, *args, **kwargs):
        if os.path.basename(path) == "goes.img":
            os.unlink(path)  # really removed, between the listing and the lstat
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(criu_images.os, "lstat", lstat_after_removal)
    assert image_bytes(tmp_path) == 10


def test_page_servers_an_earlier_controller_left_are_ended_at_start(tmp_path):
    """A controller killed during a migration leaves its page server waiting for a dump that
    never comes: the next one ends those its PID files name, and only those (a PID file
    whose PID is now another process is only removed)."""
    import subprocess
    import sys

    from ckpt_controller.criu_images import PageServer, reap_page_servers

    left = tmp_path / "e1" / "cap-1"
    reused = tmp_path / "e2" / "cap-2"
    for folder in (left, reused):
        folder.mkdir(parents=True)
    # what ``criu page-server -D FOLDER ...`` looks like in /proc: a stand-in that sleeps
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                               "page-server", "-D", str(left.resolve())])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # until it has exec'd, the child's /proc cmdline is still this test's process
        wait_until(lambda: b"page-server" in Path(f"/proc/{server.pid}/cmdline").read_bytes(),
                   what="the stand-in page server started")
        (left / PageServer.PIDFILE).write_text(f"{server.pid}\n")
        (reused / PageServer.PIDFILE).write_text(f"{other.pid}\n")
        assert reap_page_servers(tmp_path) == [server.pid]
        assert server.wait(timeout=30) == -9 and other.poll() is None
        assert not any(tmp_path.glob(f"*/*/{PageServer.PIDFILE}"))
        assert reap_page_servers(tmp_path) == []
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait()
