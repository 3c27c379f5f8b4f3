"""An image's manifest (``controller.manifest``) without CRIU: the facts it records of this
host and of a real engine process, what counts as a difference (a CPU extension missing, a
model file changed, a version), what an operator accepts, a damaged manifest refused. The
manifest of a real dump, and a restore refused and accepted: ``tests/hooks/test_criu_manifest.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from ckpt_controller.controller import manifest
from ckpt_controller.errors import CompatibilityError, UsageError
from support.timing import wait_until


@pytest.fixture
def engine(spawn_reference):
    """A real engine process (it maps torch's libraries from this venv's site-packages)."""
    return spawn_reference("mf")


def write_image(tmp_path, pid: int):
    """An image folder whose manifest describes process ``pid``, with one model file."""
    model = tmp_path / "weights.safetensors"
    model.write_bytes(os.urandom(4096))
    folder = tmp_path / "e1" / "op-1"
    folder.mkdir(parents=True)
    checked, info = manifest.engine_facts(pid, "native", {"weights": str(model)})
    manifest.write(folder, "e1", "op-1", checked, info, image_bytes=123)
    return folder, model


@pytest.fixture
def image(tmp_path):
    """``write_image`` of this test's own process."""
    return write_image(tmp_path, os.getpid())


def test_the_manifest_records_the_host_and_the_engine(tmp_path, engine):
    import torch

    folder, model = write_image(tmp_path, engine.pid)
    found = manifest.read(folder)
    c = found.checked
    assert set(manifest.CHECKED) <= set(c)
    assert c["kernel"] == os.uname().release and c["arch"] == os.uname().machine
    assert c["engine_kind"] == "native"
    # read from the site-packages folder the engine maps torch from: nothing was run
    assert c["python"] == [f"{sys.version_info[0]}.{sys.version_info[1]}"]
    assert c["torch"] == [torch.__version__] and c["vllm"] is None
    assert found.info["site_packages"] == [str(Path(torch.__file__).parents[1])]
    assert c["model"] == {str(model): manifest.sha256(model)}
    argv = Path(f"/proc/{engine.pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert found.info["pid"] == engine.pid and found.info["argv"] == argv[:64]
    assert found.info["image_bytes"] == 123
    assert found.info["exe"] == os.readlink(f"/proc/{engine.pid}/exe")
    assert abs(found.wall - time.time()) < 60
    # here and now, nothing differs
    assert manifest.differences(found, manifest.here(found)) == []
    assert manifest.check(folder, "e1", "op-1") is not None


def rewrite(folder, **checked) -> None:
    path = folder / manifest.FILE
    doc = json.loads(path.read_text())
    doc["checked"].update(checked)
    path.write_text(json.dumps(doc))


def test_each_difference_is_named_and_only_the_accepted_ones_pass(image):
    folder, model = image
    found = manifest.read(folder)
    rewrite(folder, kernel="0.0.1-elsewhere", cpu_isa=found.checked["cpu_isa"] + ["amx_fake"],
            torch=["0.0.1"])
    model.write_bytes(os.urandom(4096))  # the model file changed since the capture
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1")
    err = caught.value
    assert err.exit_code == 2
    fields = [d["field"] for d in err.details["differences"]]
    assert fields == ["kernel", "cpu_isa", "torch", "model"], fields
    cpu = err.details["differences"][1]
    assert cpu["missing"] == ["amx_fake"]
    assert "this CPU lacks amx_fake" in err.message and "0.0.1-elsewhere" in err.message
    assert "--accept cpu_isa,kernel,model,torch" in err.details["change"]
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1", accept=["kernel", "cpu_isa", "torch"])
    assert [d["field"] for d in caught.value.details["differences"]] == ["model"]
    assert manifest.check(folder, "e1", "op-1", accept=["kernel", "cpu_isa", "torch", "model"])
    with pytest.raises(UsageError) as caught:
        manifest.check(folder, "e1", "op-1", accept=["kernal"])
    assert "kernal" in caught.value.message


def test_an_extra_cpu_extension_here_is_no_difference(image):
    folder, _ = image
    found = manifest.read(folder)
    rewrite(folder, cpu_isa=found.checked["cpu_isa"][:1])
    assert manifest.check(folder, "e1", "op-1") is not None


def test_a_model_file_touched_but_the_same_keeps_matching(image):
    folder, model = image
    os.utime(model, ns=(time.time_ns(), time.time_ns() - 10**9))  # times differ: read again
    assert manifest.check(folder, "e1", "op-1") is not None
    model.unlink()
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1")
    assert "missing or unreadable here" in caught.value.message


@pytest.mark.parametrize("content", [b"not json", b"[" * 50_000 + b"]" * 50_000,
                                     b'{"engine": 3}', b""])
def test_a_damaged_manifest_is_refused_not_ignored(image, content):
    folder, _ = image
    (folder / manifest.FILE).write_bytes(content)
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1")
    assert manifest.FILE in caught.value.message
    assert "--accept manifest" in caught.value.details["change"]
    assert manifest.check(folder, "e1", "op-1", accept=["manifest"]) is None  # unchecked


@pytest.mark.parametrize("group, field, value", [
    ("checked", "model", [1, 2]), ("checked", "cpu_isa", 5), ("checked", "kernel", 3),
    ("info", "site_packages", 5), ("info", "exe", 7), ("info", "model_files", {"/x": 3}),
])
def test_a_manifest_whose_fields_have_other_types_is_refused_as_damaged(image, group, field,
                                                                         value):
    """A manifest from elsewhere is read whole or not at all: a field of another type (a
    list where a map was) is a damaged manifest, never a crash in the middle of a check."""
    folder, _ = image
    doc = json.loads((folder / manifest.FILE).read_text())
    doc[group][field] = value
    (folder / manifest.FILE).write_text(json.dumps(doc))
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1")
    assert "not a manifest" in caught.value.message, caught.value.message


def test_a_manifest_that_is_a_fifo_or_too_large_is_refused_at_once(image):
    folder, _ = image
    (folder / manifest.FILE).unlink()
    os.mkfifo(folder / manifest.FILE)  # read whole, it would block for ever
    with pytest.raises(CompatibilityError) as caught:
        manifest.check(folder, "e1", "op-1")
    assert "not a regular file" in caught.value.message
    (folder / manifest.FILE).unlink()
    (folder / manifest.FILE).write_bytes(b" " * (manifest.MAX_BYTES + 1))
    with pytest.raises(CompatibilityError):
        manifest.check(folder, "e1", "op-1")


def test_an_image_without_a_manifest_is_restored_unchecked(tmp_path):
    assert manifest.check(tmp_path, "e1", "op-old") is None


def test_a_manifest_from_a_later_format_keeps_its_known_fields(image):
    folder, _ = image
    doc = json.loads((folder / manifest.FILE).read_text())
    doc["checked"]["a_future_field"] = "x"
    doc["a_future_key"] = {"y": 1}
    (folder / manifest.FILE).write_text(json.dumps(doc))
    assert manifest.check(folder, "e1", "op-1") is not None
    assert msgspec.json.decode((folder / manifest.FILE).read_bytes())["a_future_key"]


def test_nothing_a_path_names_is_run_or_read_without_end(tmp_path):
    """The controller runs as root: an engine (or a manifest from elsewhere) naming a FIFO,
    a device or the kernel's files gets no digest, at once; a command line naming a program
    runs nothing."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", "/proc/kcore", "/proc/self/status", tmp_path / "gone"):
        assert manifest.sha256(path) is None, path
    trap = tmp_path / "python3"
    trap.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\n")
    trap.chmod(0o755)
    proc = subprocess.Popen(["bash", "-c", f"exec -a {trap} sleep 30"])
    try:
        wait_until(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(
            str(trap).encode()), 10, "the renamed process")
        checked, info = manifest.engine_facts(proc.pid, "native", {"w": str(fifo)})
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "ran").exists()
    assert checked["model"] == {str(fifo): None} and checked["python"] is None
    assert info["site_packages"] == [] and info["argv"][0] == str(trap)
