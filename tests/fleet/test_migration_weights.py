"""A level-2 migration leaves the weights behind: the target must read the same weight file,
checked before anything happens to the engine (``fleet.migration.weights``).

Both nodes run on one host here, so the target's controller gets a mount namespace of its
own in which the model folder is another one: empty (it cannot read the file), or holding a
file of the same name with other bytes. Either way the migration ends ``stayed`` and the
engine was never prepared: same process, same generation, serving on the source.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.criu import migration_missing, required
from support.hooks import CRIU_HOOKS, link_hooks
from support.processes import ControllerProcess
from support.timing import scaled, wait_until
from test_migration import Pair

pytestmark = pytest.mark.fleet

_reason = required(migration_missing(), "the migration tests")


class OtherModels(Pair):
    """n2's controller sees ``other`` where the model folder is (a bind mount in a mount
    namespace of its own); n1's sees the real one."""

    def __init__(self, d: Path, model_dir: Path, other: Path, **kw) -> None:
        self.other = other
        super().__init__(d, model_dir, "shared", **kw)

    def start_controller(self, node: str, transport: str) -> ControllerProcess:
        if node != "n2":
            return super().start_controller(node, transport)
        d = self.d / node
        link_hooks(d / "hooks", CRIU_HOOKS)
        wrap = [*self.made.enter(self.ns[node]), "unshare", "--mount", "--propagation",
                "private", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"',
                str(self.other), str(self.model_dir)]
        ctl = ControllerProcess(d, self.toml(node, transport), wrap=wrap)
        self.controllers[node] = ctl
        self.started.append(ctl)
        return ctl


def _serving(pair: OtherModels) -> dict:
    """m0 started on n1; its record once RUNNING there."""
    pair.start_engine()
    wait_until(lambda: pair.running_on("n1"), timeout_s=scaled(60), every_s=0.2,
               what="m0 RUNNING on n1 in the registry")
    return pair.engine_record()


def _stays_untouched(pair: OtherModels, *extra: str) -> dict:
    """Migrate m0 (``extra`` flags): it ends ``stayed`` before the source prepared it."""
    before = pair.engine_record()
    assert before["reload_files"], before  # the engine says what it re-wakes from
    mig = pair.migrate(*extra)
    out, err = mig.communicate(timeout=scaled(120))
    assert mig.returncode != 0, out + err
    doc = json.loads(out)["migration"]
    assert doc["outcome"] == "stayed", doc
    after = pair.running_on("n1")
    assert after is not None, pair.engine_record()
    # never prepared: the same process, its generation unchanged
    assert (after["pid"], after["generation"]) == (before["pid"], before["generation"])
    with pair.etcd.client() as c:
        from ckpt_controller.fleet.keys import Keys

        assert c.get(Keys("/ckpt").lock("m0")) is None  # free for the next operation
    return doc


@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_a_target_that_cannot_read_the_weight_file_refuses_before_the_dump(tmp_path):
    model, empty = tmp_path / "model", tmp_path / "empty"
    model.mkdir()
    empty.mkdir()
    pair = OtherModels(tmp_path, model, empty)
    try:
        path = _serving(pair)["reload_files"]["weights"]
        doc = _stays_untouched(pair)  # the nodes' default level: 2
        assert [d["step"] for d in doc["done"]] == ["receive"], doc
        assert doc["error"].startswith("the target could not receive it: n2 cannot read "
                                       f"{path}, the file m0 re-wakes its weights from"), doc
        assert "No such file or directory" in doc["error"], doc
    finally:
        pair.close()


@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_a_target_with_other_weights_is_refused_before_the_source_prepares(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    pair = OtherModels(tmp_path, model, other, level=0)
    try:
        path = Path(_serving(pair)["reload_files"]["weights"])
        # the same name on n2, one byte changed
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        (other / path.name).write_bytes(bytes(data))
        doc = _stays_untouched(pair, "--level", "2")  # asked, over the nodes' level 0
        assert [d["step"] for d in doc["done"]] == ["receive", "send", "abandon"], doc["error"]
        receive = doc["done"][0]["detail"]
        assert [line[66:] for line in receive["weights"]] == [str(path)], receive
        assert doc["error"].startswith(f"the source could not send it: {path} differs on n2 "
                                       "(sha256 "), doc
        assert "from n1's (sha256 " in doc["error"], doc
        # at level 0 the weights go with the image: nothing is read, nothing refused
        mig = pair.migrate("--level", "0", "--op-id", "mv0")
        out, err = mig.communicate(timeout=scaled(180))
        assert mig.returncode == 0, out + err
        moved = json.loads(out)["migration"]
        assert moved["outcome"] == "moved", moved
        assert "weights" not in moved["done"][0]["detail"], moved
    finally:
        pair.close()
