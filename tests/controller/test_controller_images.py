"""Which image a capture made and a restore restores: a capture that ran no dump hook says so
(and is an error with ``require_dump``); a restore names its image and refuses one from an
older generation unless it is named explicitly. A real ``ckptctl serve``, real agents, real
hook executables (shell scripts standing in for criu-dump and criu-restore)."""

from __future__ import annotations

import json

import pytest

from ckpt_controller.agent import AgentClient
from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.errors import UsageError
from support.config import engines_toml
from support.hooks import write_hook


@pytest.fixture
def agent(ipc_dir):
    from ckpt_controller.agent import Agent

    a = Agent("im1", control=f"ipc://{ipc_dir}/im1.ctl", heartbeat_interval_s=0.2).start()
    yield a
    a.close()


def _state(agent) -> tuple[str, int]:
    with AgentClient(agent.endpoint) as c:
        st = c.status()
    return st.state, st.generation


def test_a_capture_without_a_dump_hook_says_so(spawn_controller, agent):
    ctl = spawn_controller(engines_toml(agent))
    assert ctl.ckptctl("prepare", "im1").returncode == 0
    out = ctl.ckptctl("capture", "im1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["dumped"] is False and o["image"] is None
    human = ctl.ckptctl("capture", "im1")
    assert human.returncode == 0
    assert "no dump hook ran: nothing was captured" in human.stdout, human.stdout
    # with a dump hook the capture names the image it made
    write_hook(ctl, "dump", "10-stand-in", 'echo dumped > "$CKPT_IMAGE_DIR/image"')
    out = ctl.ckptctl("capture", "im1", "--json", "--op-id", "cap")
    (o,) = json.loads(out.stdout)["engines"]
    assert o["dumped"] is True and o["image"] == "cap"
    human = ctl.ckptctl("capture", "im1", "--op-id", "cap2")
    assert "captured image cap2" in human.stdout, human.stdout


def test_require_dump_makes_a_capture_without_one_an_error(spawn_controller, agent):
    ctl = spawn_controller(engines_toml(agent), controller_keys="require_dump = true\n")
    out = ctl.ckptctl("cycle", "im1", "--json")
    assert out.returncode == 2, out.stdout + out.stderr
    err = json.loads(out.stdout)["error"]
    assert "require_dump" in err["message"] and "dump hook" in err["message"], err
    assert _state(agent) == ("running", 0)  # refused before it was taken out of service
    assert ctl.ckptctl("prepare", "im1").returncode == 0
    out = ctl.ckptctl("capture", "im1", "--json", "--op-id", "nodump")
    assert out.returncode == 2, out.stdout + out.stderr
    assert _state(agent) == ("prepared", 0)  # nothing was done to it
    hist = json.loads(ctl.ckptctl("history", "--op-id", "nodump", "--json").stdout)
    assert hist["operations"] == []
    write_hook(ctl, "dump", "10-stand-in", 'echo dumped > "$CKPT_IMAGE_DIR/image"')
    out = ctl.ckptctl("capture", "im1", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["engines"][0]["dumped"] is True


def test_a_restore_names_its_image_and_refuses_an_older_generations(spawn_controller, agent):
    ctl = spawn_controller(engines_toml(agent))
    write_hook(ctl, "dump", "10-stand-in", 'echo "$CKPT_OP_ID" > "$CKPT_IMAGE_DIR/image"')
    # a pre-restore hook that says which image it would restore (criu-restore's default)
    write_hook(ctl, "pre-restore", "10-stand-in",
               'cat "$CKPT_IMAGE_DIR/../latest/image" 2>/dev/null || echo none')
    out = ctl.ckptctl("cycle", "im1", "--json", "--op-id", "c1")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["image"] == "c1" and o["generation"] == 1
    (pre,) = [h for h in o["hooks"] if h["point"] == "pre-restore"]
    assert pre["stdout_tail"].strip() == "c1"
    # a later capture dumps nothing: the newest image (c1) is a generation older
    (ctl.dir / "hooks" / "dump" / "10-stand-in").unlink()
    assert ctl.ckptctl("prepare", "im1").returncode == 0
    out = ctl.ckptctl("capture", "im1", "--json", "--op-id", "empty")
    assert json.loads(out.stdout)["engines"][0]["dumped"] is False
    out = ctl.ckptctl("restore", "im1", "--json", "--op-id", "r2")
    assert out.returncode == 2, out.stdout + out.stderr
    err = json.loads(out.stdout)["error"]
    assert err["kind"] == "UsageError" and "c1" in err["message"], err
    assert "--image c1" in err["message"] and "generation 0" in err["message"], err
    assert _state(agent) == ("prepared", 1)
    assert json.loads(ctl.ckptctl("history", "--op-id", "r2", "--json").stdout)[
        "operations"] == []
    # an image that does not exist is refused too
    with ControllerClient(ctl.endpoint) as c:
        with pytest.raises(UsageError, match="no image of im1 from operation nope"):
            c.restore(["im1"], image="nope")
    # named explicitly, the older image is restored, and the result names it
    out = ctl.ckptctl("restore", "im1", "--image", "c1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    (o,) = json.loads(out.stdout)["engines"]
    assert o["image"] == "c1" and o["state"] == "running"
    (pre,) = [h for h in o["hooks"] if h["point"] == "pre-restore"]
    assert pre["stdout_tail"].strip() == "c1"
    # in human output too
    assert ctl.ckptctl("prepare", "im1").returncode == 0
    human = ctl.ckptctl("restore", "im1", "--image", "c1")
    assert human.returncode == 0 and "restored image c1" in human.stdout, human.stdout


def test_latest_is_no_operation_id(spawn_controller, agent):
    """An operation named ``latest`` would dump into the folder of the image link
    (``<image_dir>/<engine>/latest``), leave ``latest -> latest`` and fail its own restore:
    the name is refused, by the CLI, the client and the controller (a hand-built frame)."""
    from ckpt_controller import protocol as p

    ctl = spawn_controller(engines_toml(agent))
    write_hook(ctl, "dump", "10-image", 'echo image > "$CKPT_IMAGE_DIR/pages-1.img"')
    out = ctl.ckptctl("cycle", "im1", "--op-id", "latest")
    assert out.returncode == 2 and "reserved" in out.stderr, out.stderr
    with ControllerClient(ctl.endpoint) as c:
        with pytest.raises(UsageError, match="reserved"):
            c.cycle("im1", op_id="latest")
        cmd = p.OperationCommand(call_id=0, op_id="latest", kind="cycle", engines=["im1"])
        with pytest.raises(UsageError, match="reserved"):
            c.call(p.RequestType.OPERATION, cmd, timeout_s=30)
    assert not (ctl.dir / "state" / "images" / "im1").exists()
    assert _state(agent) == ("running", 0)
