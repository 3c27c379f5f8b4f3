"""The controller's state and image directories must be private: ``criu-restore`` restores
(as root) from the image directory, and the journal lives in the state directory. A real
``ckptctl serve`` is refused at start, with the key named, when others may write in either
or replace it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckpt_controller.errors import ConfigError
from ckpt_controller.security import private_dir
from support import ROOT
from support.cli import CKPTCTL
from support.timing import scaled


def serve(tmp_path: Path, **dirs: Path) -> subprocess.CompletedProcess:
    lines = "".join(f'{key} = "{path}"\n' for key, path in dirs.items())
    config = tmp_path / "controller.toml"
    config.write_text(f'[controller]\nendpoint = "ipc://{tmp_path}/ctl.sock"\n{lines}')
    return subprocess.run([*CKPTCTL, "serve", "--config", str(config)], capture_output=True,
                          text=True, timeout=scaled(20), cwd=ROOT,
                          stdin=subprocess.DEVNULL)  # a controller that starts: TimeoutExpired


@pytest.mark.parametrize("key", ["state_dir", "image_dir"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_is_refused_at_start(tmp_path, key, mode):
    dirs = {"state_dir": tmp_path / "state", "image_dir": tmp_path / "images"}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    dirs[key].chmod(mode)
    out = serve(tmp_path, **dirs)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"controller.{key}" in out.stderr and "writable by group or others" in out.stderr
    assert str(dirs[key]) in out.stderr
    assert not (dirs["state_dir"] / "journal.sqlite3").exists()


def test_a_directory_below_one_others_may_write_is_refused(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)  # anyone may rename `images` away and put theirs there
    out = serve(tmp_path, state_dir=tmp_path / "state", image_dir=tmp_path / "open" / "images")
    assert out.returncode == 2 and "controller.image_dir" in out.stderr, out.stderr
    assert str(tmp_path / "open") in out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    os.chown(images, 65534, 65534)  # nobody
    with pytest.raises(ConfigError) as info:
        private_dir(images, "image directory")
    assert "owned by another user" in info.value.message and info.value.details["owner"] == 65534
    out = serve(tmp_path, state_dir=tmp_path / "state", image_dir=images)
    assert out.returncode == 2 and "controller.image_dir" in out.stderr, out.stderr


def test_private_directories_in_a_sticky_folder_are_fine(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: nobody may rename what is ours in it
    (sticky / "mine").mkdir(mode=0o700)
    private_dir(sticky / "mine", "state directory")
    with pytest.raises(ConfigError):  # but not as the directory itself: anyone may add files
        private_dir(sticky, "state directory")
