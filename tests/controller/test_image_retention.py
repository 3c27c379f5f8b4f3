"""Capture images do not pile up: ``[images] keep`` per engine (``controller.images``), never
the newest image, the one ``latest`` names, one an operation still uses, nor the last failed
attempts; no folder for an operation that captured nothing; ``ckptctl images list|prune``; the
disk they take in ``status`` and the metrics. The retention rule on folders made by hand, then a
real ``ckptctl serve`` whose dump hook writes a file as criu-dump writes an image."""

from __future__ import annotations

import json
import os
import time
import urllib.request

from ckpt_controller.controller.images import ImageStore
from ckpt_controller.controller.journal import Journal
from ckpt_controller.cli.common import human_bytes
from support.config import engines_toml
from support.hooks import write_hook
from support.timing import wait_until


def _folder(root, engine: str, name: str, size: int, age_s: float):
    d = root / engine / name
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(b"x" * size)
    then = time.time() - age_s
    os.utime(d, (then, then))
    return d


def test_retention_keeps_the_newest_latest_in_use_and_the_last_attempts(tmp_path):
    root = tmp_path / "images"
    journal = Journal(tmp_path / "journal.sqlite3")
    running: dict[str, list[str]] = {"e": []}
    try:
        # five good images (a1 oldest), a failed attempt before the newest and two after it
        for i, age_s in enumerate((500, 400, 300, 200, 100), start=1):
            _folder(root, "e", f"a{i}", 1000 * i, age_s)
            journal.record("capture", {"dumped": True, "generation": i}, op_id=f"a{i}",
                           engine="e")
        _folder(root, "e", "f-old", 7, 150)
        _folder(root, "e", "f-new1", 7, 50)
        _folder(root, "e", "f-new2", 7, 40)
        _folder(root, "e", "f-new3", 7, 30)
        (root / "e" / "latest").symlink_to("a1")  # a restore named the oldest
        running["e"] = ["op/with/slashes"]  # its folder: op_with_slashes
        _folder(root, "e", "op_with_slashes", 3, 20)
        store = ImageStore(root, 2, journal, running=lambda e: running.get(e, []))
        kept = {i.image: i.kept for i in store.images("e")}
        assert kept == {"a5": "newest", "a4": "newest", "a3": None, "a2": None,
                        "a1": "latest", "f-old": None, "f-new3": "last attempt",
                        "f-new2": "last attempt", "f-new1": None,
                        "op_with_slashes": "in use"}
        dry = store.prune(["e"], dry_run=True)
        assert sorted(i.image for i in dry) == ["a2", "a3", "f-new1", "f-old"]
        assert (root / "e" / "a2").is_dir()  # a dry run removes nothing
        gone = store.prune(["e"])
        assert sorted(i.image for i in gone) == ["a2", "a3", "f-new1", "f-old"]
        left = sorted(p.name for p in (root / "e").iterdir())
        assert left == ["a1", "a4", "a5", "f-new2", "f-new3", "latest", "op_with_slashes"]
        assert store.images_bytes("e") == 1000 + 4000 + 5000 + 7 + 7 + 3
        # keep 1 never removes the newest; an engine with no image keeps its last attempt
        store.prune(["e"], keep=1)
        assert {i.image for i in store.images("e")} == {"a5", "a1", "f-new3", "op_with_slashes"}
        _folder(root, "n", "x1", 5, 30)
        _folder(root, "n", "x2", 5, 20)
        store.prune(["n"], keep=1)
        assert [i.image for i in store.images("n")] == ["x2"]
        assert store.images("nothing-here") == [] and store.prune(["nothing-here"]) == []
    finally:
        journal.close()


def test_images_of_a_served_controller_stay_within_keep(spawn_controller, ipc_dir):
    from ckpt_controller.agent import Agent

    agent = Agent("ir", control=f"ipc://{ipc_dir}/ir.ctl", heartbeat_interval_s=0.2).start()
    try:
        ctl = spawn_controller("metrics_port = 0\n" + engines_toml(agent)
                               + "\n[images]\nkeep = 2\n")
        # an image as criu-dump leaves one; a pre-prepare check that writes nothing
        write_hook(ctl, "dump", "10-image",
                   'head -c 4096 /dev/zero > "$CKPT_IMAGE_DIR/pages-1.img"')
        write_hook(ctl, "pre-prepare", "10-check", "exit 0")
        folder = ctl.dir / "state" / "images" / "ir"

        def images(*args: str) -> dict:
            out = ctl.ckptctl("images", *args, "--json")
            assert out.returncode == 0, out.stdout + out.stderr
            return json.loads(out.stdout)

        for i in range(4):
            out = ctl.ckptctl("cycle", "ir", "--op-id", f"c{i}", "--json")
            assert json.loads(out.stdout)["status"] == "succeeded", out.stdout
        # the older two go after the last cycle (on a thread of their own)
        wait_until(lambda: sorted(p.name for p in folder.iterdir()) == ["c2", "c3"], 20,
                   "two images left")
        listed = images("list", "ir")
        # the dump hook's 4096 bytes, and the manifest the capture wrote beside them
        size = {c: 4096 + (folder / c / "ckpt-manifest.json").stat().st_size
                for c in ("c2", "c3")}
        assert [(i["image"], i["dumped"], i["kept"], i["bytes"]) for i in listed["images"]] \
            == [("c3", True, "newest", size["c3"]), ("c2", True, "newest", size["c2"])]
        assert listed["keep"] == 2 and listed["removed"] == []
        # an operation that captured nothing leaves no folder, though its hooks ran
        assert ctl.ckptctl("prepare", "ir", "--op-id", "p1").returncode == 0
        assert ctl.ckptctl("rollback", "ir", "--op-id", "r1").returncode == 0
        assert sorted(p.name for p in folder.iterdir()) == ["c2", "c3"]
        # prune now, to one: said first with --dry-run, then done
        dry = images("prune", "--keep", "1", "--dry-run")
        assert [i["image"] for i in dry["removed"]] == ["c2"] and dry["dry_run"] is True
        assert (folder / "c2").is_dir()
        done = images("prune", "--keep", "1")
        assert [i["image"] for i in done["removed"]] == ["c2"]
        assert [i["image"] for i in done["images"]] == ["c3"] and not (folder / "c2").exists()
        table = ctl.ckptctl("images", "list")
        assert "c3" in table.stdout and "newest" in table.stdout, table.stdout
        # the disk they take: in status and the metrics
        status = json.loads(ctl.ckptctl("status", "--json").stdout)
        assert status["engines"][0]["images_bytes"] == size["c3"]
        wide = ctl.ckptctl("status", "-o", "wide").stdout
        assert "IMAGES" in wide and human_bytes(size["c3"]) in wide, wide
        url = f"http://127.0.0.1:{ctl.info['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert f'ckpt_images_bytes{{engine="ir"}} {float(size["c3"])}' in text
        # refused: an engine it does not know, a keep of 0
        bad = ctl.ckptctl("images", "list", "nosuch", "--json")
        assert bad.returncode == 2 and "nosuch" in bad.stdout
        assert ctl.ckptctl("images", "prune", "--keep", "0").returncode == 2
    finally:
        agent.close()
