"""``fleet.migration.weights`` alone: the digests of the files a level-2 re-wake reads, and the
refusals the migration's receive and send give (no etcd, no nodes)."""

from __future__ import annotations

import hashlib
import json
import os
import time

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


class _Registry:
    """What ``Ahead`` asks of etcd: the engines' records written after a revision."""

    def __init__(self) -> None:
        self.kvs: list = []
        self.asked: list[int] = []
        self.revision = 0  # etcd's: one more at each write

    def add(self, *records) -> None:
        from ckpt_controller.fleet import records as r
        from ckpt_controller.fleet.etcd import KeyValue

        for rec in records:
            self.revision += 1
            self.kvs.append(KeyValue(key=f"/ckpt/engines/{self.revision}", value=(
                rec if isinstance(rec, bytes) else r.encode(rec)),
                create_revision=self.revision, mod_revision=self.revision, lease=0))

    def changed_since(self, prefix, revision):
        assert prefix == "/ckpt/engines/"
        self.asked.append(revision)
        return [kv for kv in self.kvs if kv.mod_revision > revision], self.revision


def _engine(name: str, node: str, **files) -> object:
    from ckpt_controller.fleet.records import EngineRecord

    return EngineRecord(engine=name, node=node, state=None, generation=None, holder=None,
                        last_op=None, labels={}, endpoints={}, reload_files=files,
                        reachable=True, pid=None, since=None, own_pid_namespace=None,
                        updated=0.0)


def test_digest_ahead_reads_the_fleets_files_held_here_again_only_when_they_change(
        tmp_path, fresh_node, monkeypatch, caplog):
    from ckpt_controller.fleet.keys import Keys
    from support.timing import wait_until

    theirs = _file(tmp_path, "theirs.safetensors", b"t" * 3000)
    shared = _file(tmp_path, "shared.safetensors", b"s" * 2000)
    mine = _file(tmp_path, "mine.safetensors", b"m" * 1000)
    later = _file(tmp_path, "later.safetensors", b"l" * 500)
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "kcore-link").symlink_to("/proc/kcore")  # the machine's memory, 128 TiB
    monkeypatch.chdir(tmp_path)
    registry = _Registry()
    registry.add(
        _engine("a", "n1", weights=theirs), _engine("b", "n3", weights=shared, lora=shared),
        _engine("c", "n2", weights=mine),  # this node's own: digested as it publishes them
        _engine("d", "n1", weights=str(tmp_path / "not-here.safetensors"),
                folder=str(tmp_path / "a-dir"), nul="x\x00y", kcore="/proc/kcore",
                relative="theirs.safetensors", link=str(tmp_path / "kcore-link")),
        b"{not a record",  # damaged: ``fleet status`` says it; left out here
    )
    monkeypatch.setattr(weights, "AHEAD_SETTLED_S", 0.0)  # just written: settled already
    ahead = weights.Ahead(registry, Keys("/ckpt"), "n2")
    reads = []
    real = weights.chunked_sha256
    monkeypatch.setattr(weights, "chunked_sha256",
                        lambda fd, size: reads.append(size) or real(fd, size))

    def looked(n: int) -> None:
        ahead.look()
        wait_until(lambda: len(reads) == n and not weights._warming,
                   what="the fleet's files digested in the background")

    # the two regular files here; not tried: the missing one, the folder, the NUL, the
    # kernel's files (named, or through a link), a relative path
    looked(2)
    assert sorted(reads) == [2000, 3000] and sorted(weights._known) == sorted([theirs, shared])
    assert ahead.files == sorted({theirs, shared, str(tmp_path / "not-here.safetensors"),
                                  str(tmp_path / "a-dir"), "x\x00y", "/proc/kcore",
                                  "theirs.safetensors", str(tmp_path / "kcore-link")})
    ahead.look()  # nothing written, no file changed: nothing read
    assert not weights._warming and len(reads) == 2 and registry.asked == [0, 5]
    assert sorted(weights._known) == sorted([theirs, shared])
    registry.add(_engine("e", "n3", weights=later))
    looked(3)  # only the record written since
    assert reads[-1] == 500 and registry.asked[-1] == 5
    with open(theirs, "ab") as f:  # a new version of the model at the same path
        f.write(b"+")
    weights.warm([theirs])  # as for its own engines: known, not looked at again
    assert not weights._warming and len(reads) == 3
    looked(4)  # its stat looked at again: read again
    assert reads[-1] == 3001 and weights.digest(theirs) == _chunked(b"t" * 3000 + b"+",
                                                                    weights.CHUNK_BYTES)
    # a file being copied in (modified just now) waits until it settled
    monkeypatch.setattr(weights, "AHEAD_SETTLED_S", 3600.0)
    with open(theirs, "ab") as f:
        f.write(b"-")
    ahead.look()
    assert not weights._warming and len(reads) == 4
    monkeypatch.setattr(weights, "AHEAD_SETTLED_S", 0.0)
    # a record deleted: its files let go at the next full read (a deletion is no write)
    registry.kvs = [kv for kv in registry.kvs if b"later.safetensors" not in kv.value]
    registry.revision += 1
    ahead.look()
    assert later in ahead.files  # not seen yet
    monkeypatch.setattr(ahead, "_full_at", 0.0)
    looked(5)  # the full read, and ``theirs`` (now settled) read again
    assert later not in ahead.files and registry.asked[-1] == 0
    # etcd made anew (its revision went back): everything read again
    registry.kvs, registry.revision = registry.kvs[:1], 1
    ahead.look()
    assert ahead.files == [theirs] and ahead.revision == 1 and registry.asked[-2:] == [7, 0]
    # more files than the cap: the first by name, said once
    monkeypatch.setattr(weights, "AHEAD_MAX_FILES", 2)
    registry.add(_engine("f", "n1", x=str(tmp_path / "x"), y=str(tmp_path / "y")))
    for _ in range(2):
        ahead.look()
    assert ahead.files == sorted([theirs, str(tmp_path / "x"), str(tmp_path / "y")])[:2]
    assert [r.message for r in caplog.records if "digest_ahead" in r.message] == [
        "fleet: the fleet's engines re-wake from 3 files; digest_ahead digests the first 2 "
        "by name"]


def test_digest_ahead_tries_a_file_it_could_not_read_again_only_later(tmp_path, fresh_node,
                                                                      monkeypatch):
    from support.timing import wait_until

    monkeypatch.setattr(weights, "AHEAD_SETTLED_S", 0.0)
    path = _file(tmp_path, "locked.safetensors", b"q" * 100)
    tries = []

    def unreadable(fd, size):
        tries.append(1)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(weights, "chunked_sha256", unreadable)
    weights.warm([path], recheck=True)
    wait_until(lambda: tries and not weights._warming, what="the failed digest")
    for _ in range(3):
        weights.warm([path], recheck=True)
    assert not weights._warming and tries == [1]  # not every look: in AHEAD_RETRY_S
    monkeypatch.setattr(weights, "AHEAD_RETRY_S", 0.0)
    weights.warm([path], recheck=True)
    wait_until(lambda: len(tries) == 2 and not weights._warming, what="tried again")


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


@pytest.fixture
def fresh_node(monkeypatch):
    """The module as a node process starts it: nothing known, nothing kept yet."""
    monkeypatch.setattr(weights, "_known", {})
    monkeypatch.setattr(weights, "_store", None)
    monkeypatch.setattr(weights, "_failed", {})

    def restart():
        monkeypatch.setattr(weights, "_known", {})
        monkeypatch.setattr(weights, "_store", None)
    return restart


def test_a_node_keeps_the_digests_in_its_state_dir_across_a_restart(tmp_path, fresh_node,
                                                                     monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    path = _file(tmp_path, "kept.safetensors", b"k" * 3000)
    weights.remember_in(state)
    want = _chunked(b"k" * 3000, weights.CHUNK_BYTES)
    assert weights.digest(path) == want
    doc = json.loads((state / weights.DIGESTS_FILE).read_text())
    assert doc["version"] == 1 and doc["files"][path]["sha256"] == want
    assert oct((state / weights.DIGESTS_FILE).stat().st_mode & 0o777) == "0o600"
    fresh_node()  # the node restarts, after one of its processes was killed while saving
    left = state / f".{weights.DIGESTS_FILE}.{os.getpid() + 1}"
    left.write_text('{"version": 1, "files": {')
    other = state / f".{weights.DIGESTS_FILE}.bak"  # not one of a save: left alone
    other.write_text("{}")
    weights.remember_in(state)
    assert not left.exists() and other.exists()  # removed at the start
    reads = []
    real = weights.chunked_sha256
    monkeypatch.setattr(weights, "chunked_sha256",
                        lambda fd, size: reads.append(1) or real(fd, size))
    assert weights.digest(path) == want and reads == []  # not read again
    weights.warm([path])
    assert not weights._warming  # known: nothing to do ahead either
    changed = os.stat(path).st_ctime_ns
    with open(path, "r+b") as f:  # the same size and times, other bytes: its change time moved
        mtime = os.stat(path).st_mtime_ns
        f.write(b"j")
    os.utime(path, ns=(mtime, mtime))
    while os.stat(path).st_ctime_ns == changed:  # within one tick of the kernel's clock
        time.sleep(0.001)
        os.utime(path, ns=(mtime, mtime))
    assert weights.digest(path) == _chunked(b"j" + b"k" * 2999, weights.CHUNK_BYTES)
    assert reads == [1]
    os.replace(_file(tmp_path, "other", b"k" * 3000), path)  # another file by the same name
    assert weights.digest(path) == want and reads == [1, 1]


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"version": 2, "files": {}}',
                                  "[" * 100_000, b"\xff\xfe".decode("latin-1"),
                                  '{"version": 1, "files": []}'])
def test_a_damaged_table_of_digests_is_said_and_made_anew(tmp_path, fresh_node, caplog, text):
    state = tmp_path / "state"
    state.mkdir()
    (state / weights.DIGESTS_FILE).write_text(text, encoding="latin-1")
    path = _file(tmp_path, "w.safetensors", b"d" * 100)
    with caplog.at_level("WARNING", logger="ckpt_controller.fleet"):
        weights.remember_in(state)  # a node with a damaged cache starts
    assert "is not a table of weight digests" in caplog.text
    assert weights.digest(path) == _chunked(b"d" * 100, weights.CHUNK_BYTES)
    doc = json.loads((state / weights.DIGESTS_FILE).read_text())
    assert list(doc["files"]) == [path]


def test_entries_of_the_wrong_shape_are_left_out_and_an_unwritable_table_is_said(
        tmp_path, fresh_node, caplog):
    state = tmp_path / "state"
    state.mkdir()
    path = _file(tmp_path, "w.safetensors", b"e" * 100)
    good = {"stat": list(weights._key(os.stat(path))), "sha256": "0" * 64}
    (state / weights.DIGESTS_FILE).write_text(json.dumps({"version": 1, "files": {
        path: good, "/a": {"stat": [1, 2, 3], "sha256": "0" * 64},
        "/b": {"stat": [1, 2, 3, 4, "5"], "sha256": "0" * 64},
        "/c": {"stat": [1, 2, 3, 4, 5], "sha256": "X" * 64}, "/d": [1], "/e": None}}))
    weights.remember_in(state)
    assert set(weights._known) == {path}
    assert weights.digest(path) == "0" * 64  # what the table says of the same file
    (state / weights.DIGESTS_FILE).unlink()
    (state / weights.DIGESTS_FILE).mkdir()  # cannot be replaced: said, the digest still made
    other = _file(tmp_path, "x.safetensors", b"x" * 10)
    with caplog.at_level("WARNING", logger="ckpt_controller.fleet"):
        assert weights.digest(other) == _chunked(b"x" * 10, weights.CHUNK_BYTES)
    assert "could not keep the weight digests" in caplog.text
    assert not [p for p in state.iterdir() if p.name.startswith(".")]  # no temporary left


def test_digest_ahead_looks_again_after_etcd_was_away_and_ends_with_the_node(
        tmp_path, fresh_node, monkeypatch):
    import threading

    from ckpt_controller.errors import UnreachableError
    from ckpt_controller.fleet.keys import Keys
    from support.timing import wait_until

    path = _file(tmp_path, "there.safetensors", b"a" * 700)
    registry = _Registry()
    registry.add(_engine("a", "n1", weights=path))
    real, calls = registry.changed_since, []

    def flaky(prefix, revision):
        calls.append(revision)
        if len(calls) <= 2:  # etcd away for the first two looks
            raise UnreachableError("no etcd member answered")
        return real(prefix, revision)

    registry.changed_since = flaky
    monkeypatch.setattr(weights, "AHEAD_EVERY_S", 0.01)
    monkeypatch.setattr(weights, "AHEAD_SETTLED_S", 0.0)
    stop = threading.Event()
    looks = threading.Thread(target=weights.Ahead(registry, Keys("/ckpt"), "n2").run,
                             args=(stop,))
    looks.start()
    try:
        wait_until(lambda: path in weights._known, what="the file digested once etcd answers")
    finally:
        stop.set()
        looks.join(timeout=10)
    assert not looks.is_alive()
    assert calls[:3] == [0, 0, 0]  # nothing missed while etcd was away
