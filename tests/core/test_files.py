"""Files a person names (the config, key files) are read only when they are regular files of a
sane size: a device, a FIFO, a directory or a huge file is refused at once, naming what it is
(``/dev/zero`` once read 1.6 GiB before failing, and a FIFO hung the start for 40 s)."""

from __future__ import annotations

import os
import threading

import pytest

from ckpt_controller import security
from ckpt_controller.controller.config import MAX_CONFIG_BYTES, load_config
from ckpt_controller.errors import ConfigError
from ckpt_controller.files import UnfitFileError, read_small
from support.cli import ckptctl
from support.timing import scaled


def within(seconds: float, call):
    """``call()``'s result or exception, failing the test when it takes longer than
    ``seconds`` (``scaled``): a read that blocks must not hang the suite."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as err:  # the caller looks at what it raised
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(scaled(seconds))
    assert not worker.is_alive(), f"still reading after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.toml"
    os.mkfifo(path)
    return path


def test_a_regular_file_and_a_link_to_one_are_read_whole(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"x" * 1000)
    (tmp_path / "link.toml").symlink_to(path)
    assert read_small(path, 1000) == b"x" * 1000
    assert read_small(tmp_path / "link.toml", 4096) == b"x" * 1000
    with pytest.raises(UnfitFileError, match="1000 bytes, more than the 999"):
        read_small(path, 999)
    with pytest.raises(FileNotFoundError):
        read_small(tmp_path / "none.toml", 10)
    with pytest.raises(UnfitFileError, match="NUL byte"):
        read_small(f"{tmp_path}/c\0.toml", 10)
    with pytest.raises(ConfigError, match="NUL byte"):
        load_config(f"{tmp_path}/c\0.toml")


@pytest.mark.parametrize("where,what", [("/dev/zero", "character device"),
                                        ("/dev/null", "character device"),
                                        (None, "FIFO"), ("dir", "directory")])
def test_anything_but_a_regular_file_is_refused_before_a_read(where, what, tmp_path, fifo):
    path = {None: fifo, "dir": tmp_path}.get(where, where)
    with pytest.raises(UnfitFileError, match=f"not a regular file but a {what}"):
        within(5, lambda: read_small(path, 1 << 20))


def test_the_config_refuses_a_device_a_fifo_and_a_huge_file_at_once(tmp_path, fifo):
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as f:  # sparse: its size, not its bytes on disk
        f.truncate(MAX_CONFIG_BYTES + 1)
    for path, words in (("/dev/zero", "character device"), (fifo, "FIFO"),
                        (huge, f"more than the {MAX_CONFIG_BYTES}")):
        with pytest.raises(ConfigError, match=f"cannot read the file: .*{words}") as info:
            within(5, lambda path=path: load_config(path))
        assert info.value.details["file"] == str(path) and info.value.exit_code == 2


def test_a_key_file_that_is_no_file_is_refused(fifo):
    for path, words in (("/dev/zero", "character device"), (fifo, "FIFO")):
        with pytest.raises(ConfigError, match=f"cannot read the key file .*{words}"):
            within(5, lambda path=path: security.load(path, secret=False))


@pytest.mark.parametrize("args", [["serve", "--config", "{fifo}"],
                                  ["serve", "--config", "/dev/zero"],
                                  ["--curve-key", "{fifo}", "--curve-server-key", "{fifo}",
                                   "status", "--json"]])
def test_ckptctl_given_such_a_path_exits_2_at_once(args, fifo):
    out = ckptctl(*[a.format(fifo=fifo) for a in args], timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not a regular file" in out.stdout + out.stderr

