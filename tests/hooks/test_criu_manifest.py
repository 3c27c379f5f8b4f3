"""The manifest of a real CRIU image: written by the capture that dumped it, shown by
``ckptctl images inspect`` (table and ``-o json``), and checked before the restore: refused
(exit 2, ``CompatibilityError`` naming each difference, nothing restored, the engine left as
it was) when the image records a host this one is not, restored with ``--accept``. Needs CRIU
(``make criu``) and root."""

from __future__ import annotations

import json

import pytest

from ckpt_controller.controller import manifest
from ckpt_controller.engine.client import EngineClient
from support.config import engines_toml
from support.criu import criu_missing, required, tcp_engine
from support.hooks import CRIU_HOOKS, link_hooks
from support.processes import kill_naming
from support.timing import scaled

_reason = required(criu_missing(), "the CRIU manifest test")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""),
              pytest.mark.exec_engines]


def test_a_captures_manifest_is_shown_refused_on_a_difference_and_accepted(
        spawn_reference, spawn_controller, monkeypatch):
    monkeypatch.setenv("CKPT_CRIU_MODE", "stop")  # hooks get the controller's environment
    eng = tcp_engine(spawn_reference, "cmf")
    try:
        ctl = spawn_controller(engines_toml(eng, defaults='drain = "keep"\nlevel = 2'))
        link_hooks(ctl, CRIU_HOOKS)
        with EngineClient(eng.api) as api:
            want = api.generate([4, 2, 4], 20).token_ids
        assert ctl.ckptctl("prepare", eng.name).returncode == 0
        out = ctl.ckptctl("capture", eng.name, "--json", "--op-id", "cap-1")
        assert out.returncode == 0, out.stdout + out.stderr
        eng.proc.wait(timeout=scaled(10))  # the dump ended it; its PIDs free for the restore
        folder = ctl.dir / "state" / "images" / eng.name / "cap-1"
        found = manifest.read(folder)
        assert found.engine == eng.name and found.image == "cap-1"
        assert found.checked["criu"] and found.checked["engine_kind"] == "native"
        assert list(found.checked["model"].values())[0] is not None  # the weights' digest
        assert found.info["image_bytes"] > 1 << 20
        # shown, by operation id (the controller says where) and by folder, as a table
        out = ctl.ckptctl("images", "inspect", "cap-1")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Restores here: yes" in out.stdout and "criu " in out.stdout, out.stdout
        doc = json.loads(ctl.ckptctl("images", "inspect", str(folder), "-o", "json").stdout)
        assert doc["kind"] == "image-manifest" and doc["restores_here"] is True
        assert doc["manifest"]["checked"]["kernel"] == doc["here"]["kernel"]
        assert "written_at" in doc["manifest"] and doc["differences"] == []
        # the image says another kernel and a CPU extension this one lacks
        path = folder / manifest.FILE
        saved = json.loads(path.read_text())
        saved["checked"]["kernel"] = "9.9.9-elsewhere"
        saved["checked"]["cpu_isa"] = saved["checked"]["cpu_isa"] + ["amx_elsewhere"]
        path.write_text(json.dumps(saved))
        out = ctl.ckptctl("images", "inspect", "cap-1")
        assert "Restores here: no" in out.stdout and "--accept cpu_isa,kernel" in out.stdout
        out = ctl.ckptctl("restore", eng.name, "--json")
        assert out.returncode == 2, out.stdout + out.stderr
        err = json.loads(out.stdout)["error"]
        assert err["kind"] == "CompatibilityError", err
        assert [d["field"] for d in err["details"]["differences"]] == ["kernel", "cpu_isa"]
        assert "9.9.9-elsewhere" in err["message"] and "amx_elsewhere" in err["message"]
        assert not list(folder.glob("restore.log"))  # CRIU never ran
        history = json.loads(ctl.ckptctl("history", "--engine", eng.name, "--json").stdout)
        assert all(o["operation"] != "restore" for o in history["operations"])  # refused
        # accepting one field is not enough; both restore it
        out = ctl.ckptctl("restore", eng.name, "--accept", "kernel", "--json")
        assert out.returncode == 2 and "amx_elsewhere" in out.stdout, out.stdout
        out = ctl.ckptctl("restore", eng.name, "--accept", "kernel,cpu_isa", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["engines"][0]["state"] == "running"
        with EngineClient(eng.api) as api:
            assert api.generate([4, 2, 4], 20).token_ids == want
    finally:  # the restored copy is no child of ours: end it by its PID
        kill_naming(eng.control, [eng.pid])
