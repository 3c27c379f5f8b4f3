"""What a vLLM sidecar keeps on disk for its successor, and the controller's policy for an
engine found FAILED after an operation lost it before any capture. No vLLM needed: the
sidecar against a real one is in ``test_vllm_adapter.py`` (``-m vllm``)."""

from __future__ import annotations

import json

import pytest

from ckpt_controller.adapters.vllm.state import Progress, StateFile, state_path
from ckpt_controller.controller.config import parse_config
from ckpt_controller.errors import ConfigError


def test_the_state_survives_a_new_reader_and_is_private(tmp_path):
    path = state_path(f"ipc://{tmp_path}/vl", "vl")
    assert path == tmp_path / "vl.state"  # beside the control socket
    first = StateFile(path)
    assert first.state.generation == 0 and first.state.progress == Progress()
    first.state.generation = 3
    first.state.progress = Progress(released=["kv_cache", "weights"], level=1,
                                    checkpoint_prepared=True, golden="abc",
                                    checksums={"w": "01"})
    first.save()
    again = StateFile(path).state
    assert again.generation == 3 and again.progress == first.state.progress
    assert path.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_a_state_about_another_vllm_process_starts_afresh(tmp_path):
    """A brand-new vLLM under the same name (another process, started later) once went on
    with the old one's generation; the state records its process's start time and a
    sidecar beside another process starts afresh. The same process (its start time read
    again) keeps it; an unknown start time keeps it too."""
    path = tmp_path / "vl.state"
    first = StateFile(path)
    assert first.belongs_to(1000.0)
    first.state.generation = 4
    first.state.progress = Progress(released=["weights"], level=1)
    first.save()
    same = StateFile(path)
    assert same.belongs_to(1000.3) and same.belongs_to(None)
    assert same.state.generation == 4 and same.state.progress.level == 1
    new = StateFile(path)
    assert not new.belongs_to(5000.0)
    assert new.state.generation == 0 and new.state.progress == Progress()
    again = StateFile(path).state  # saved: the new process's, from generation 0
    assert again.generation == 0 and again.engine_started == 5000.0


def test_an_unreadable_state_starts_afresh(tmp_path):
    path = tmp_path / "vl.state"
    path.write_text("{not json")
    assert StateFile(path).state.generation == 0
    path.write_text(json.dumps({"generation": 2, "progress": {"unknown": 1}}))
    assert StateFile(path).state.generation == 0


def test_a_tcp_sidecar_keeps_its_state_in_the_runtime_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = state_path("tcp://127.0.0.1:7001", "llm0")
    assert path.name == "llm0.vllm-state" and path.parent.is_dir()


def test_recover_uncaptured_is_resume_unless_set_to_leave():
    assert parse_config("").recover_uncaptured == "resume"
    text = '[controller]\nrecover_uncaptured = "leave"\n'
    assert parse_config(text).recover_uncaptured == "leave"
    with pytest.raises(ConfigError) as err:
        parse_config('[controller]\nrecover_uncaptured = "retry"\n')
    assert err.value.details["key"] == "controller.recover_uncaptured"
