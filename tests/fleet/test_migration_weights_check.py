"""``fleet.migration.weights`` alone: the digests of the files a level-2 re-wake reads, and the
refusals the migration's receive and send give (no etcd, no nodes)."""

from __future__ import annotations

import hashlib
import os

import pytest

from ckpt_controller.errors import OperationError
from ckpt_controller.fleet.migration import weights


def _chunked(data: bytes, chunk: int) -> str:
    """``weights.chunked_sha256`` written out: the SHA-256 of the pieces' SHA-256s and the
    size."""
    pieces = [data[i:i + chunk] for i in range(0, max(len(data), 1), chunk)]
    inner = b"".join(hashlib.sha256(p).digest() for p in pieces)
    return hashlib.sha256(inner + len(data).to_bytes(8, "little")).hexdigest()


def _file(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_the_digest_is_a_chunked_sha256_read_again_only_when_the_file_changed(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1000)  # five pieces, hashed side by side
    monkeypatch.setattr(weights, "READ_BYTES", 300)
    path = _file(tmp_path, "w.safetensors", b"x" * 4096)
    assert weights.digest(path) == _chunked(b"x" * 4096, 1000)
    reads = []
    real = weights.chunked_sha256
    monkeypatch.setattr(weights, "chunked_sha256",
                        lambda fd, size: reads.append(1) or real(fd, size))
    weights.digest(path)
    assert reads == []  # unchanged: the kept digest
    with open(path, "r+b") as f:  # same size, other bytes, a later modification time
        f.write(b"y")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert weights.digest(path) == _chunked(b"y" + b"x" * 4095, 1000)
    assert reads == [1]
    empty = _file(tmp_path, "empty.safetensors", b"")
    assert weights.digest(empty) == _chunked(b"", 1000)


def test_a_node_digests_its_engines_files_ahead_and_a_send_reads_none(tmp_path,
                                                                      monkeypatch):
    from support.timing import wait_until

    path = _file(tmp_path, "ahead.safetensors", b"z" * 5000)
    missing = str(tmp_path / "not-there.safetensors")
    weights.warm([path, missing])  # a file it cannot read is the migration's to say
    wait_until(lambda: path in weights._known and not weights._warming,
               what="the digest made in the background")
    reads = []
    monkeypatch.setattr(weights, "chunked_sha256", lambda fd, size: reads.append(1) or "x")
    assert weights.read_all({"weights": path}, "n1", "m0") == {
        path: _chunked(b"z" * 5000, weights.CHUNK_BYTES)}
    assert reads == []
    weights.warm([path])  # known: nothing started
    assert not weights._warming


def test_what_the_target_cannot_read_is_named_and_a_fifo_never_blocks(tmp_path):
    missing = str(tmp_path / "gone.safetensors")
    with pytest.raises(OperationError) as err:
        weights.read_all({"weights": missing}, "n2", "m0")
    assert err.value.message == (
        f"n2 cannot read {missing}, the file m0 re-wakes its weights from after a level-2 "
        "move: No such file or directory; give n2 the same file at that path, or migrate "
        "with --level 0")
    fifo = tmp_path / "w.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OperationError, match="is not a regular file"):
        weights.read_all({"weights": str(fifo)}, "n2", "m0")  # returns: nobody writes it
    with pytest.raises(OperationError, match="Is a directory|is not a regular file"):
        weights.read_all({"weights": str(tmp_path)}, "n2", "m0")


def test_the_source_refuses_weights_that_differ_or_were_not_read_there(tmp_path):
    path = _file(tmp_path, "w.safetensors", b"abc")
    mine = weights.read_all({"weights": path}, "n1", "m0")
    same = weights.lines(mine)
    assert same == [f"{_chunked(b'abc', weights.CHUNK_BYTES)}  {path}"]
    weights.compare({"weights": path}, same, "n1", "n2", "m0")  # the same bytes: no error
    other = [f"{_chunked(b'abd', weights.CHUNK_BYTES)}  {path}"]
    with pytest.raises(OperationError) as err:
        weights.compare({"weights": path}, other, "n1", "n2", "m0")
    assert err.value.message.startswith(
        f"{path} differs on n2 (sha256 {_chunked(b'abd', weights.CHUNK_BYTES)[:12]}) from "
        "n1's")
    with pytest.raises(OperationError, match=r"differs on n2 \(not read there\)"):
        weights.compare({"weights": path}, [], "n1", "n2", "m0")


@pytest.mark.parametrize(("level", "reloads"), [(None, False), (0, False), (1, False),
                                                (2, True), ("2", False), ("x", False),
                                                (float("nan"), False), ([2], False)])
def test_only_level_2_reloads_from_the_file(level, reloads):
    assert weights.reloads(level) is reloads
