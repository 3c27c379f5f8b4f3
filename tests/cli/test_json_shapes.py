"""Every ``--json`` document against docs/json.md: real processes (a controller, reference and
step engines, etcd where it is installed), each command run as a script runs it, and its
output checked field by field against the tables the doc has (parsed here, so that the doc
cannot drift from the code): every key documented, every documented key there, each value of
its documented type, no ``type`` key naming an internal Struct, every ``*_at`` ISO 8601.

Set ``CKPT_JSON_EXAMPLES=DIR`` to keep each document in DIR (the doc's examples come from there).
Neighbours: ``cli.output`` (the shapes), docs/json.md, ``support`` (the processes).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ckpt_controller.cli.output import SCHEMA_VERSION
from support import ROOT
from support.cli import CKPTCTL, StreamedLines, ckptctl
from support.config import engines_toml
from support.hooks import write_hook
from support.net import ipc_connections, wait_connected
from support.timing import scaled, wait_until

DOC = ROOT / "docs" / "json.md"

#: the tagged protocol Structs: a ``type`` key naming one is an internal name leaking out
STRUCT_NAMES = {"HandshakeReply", "StatusReply", "PrepareReply", "RestoreReply",
                "HeartbeatReply", "Ack", "OperationResult", "ControllerStatusReply",
                "HistoryReply", "StateChanged", "DrainProgress", "MemoryReported", "Heartbeat",
                "Journaled", "EngineView", "JournalRecord", "TransitionRecord",
                "LastOperation"}


# ---------------------------------------------------------------- the doc's tables


def doc_tables(text: str | None = None) -> dict[str, dict[str, str]]:
    """``#### `name` `` headings (or ``#### `a`, `b` `` for two shapes alike), each followed
    by a ``| field | type | meaning |`` table and maybe "Then every field of [`other`](#other)."
    (its rows come too): {name: {field: type}}."""
    text = DOC.read_text() if text is None else text
    tables: dict[str, dict[str, str]] = {}
    includes: list[tuple[dict, str]] = []  # "Then every field of [`name`](#name)."
    current = None
    for line in text.splitlines():
        m = re.match(r"^Then every field of \[`([a-z0-9-]+)`\]\(#[a-z0-9-]+\)", line)
        if m and current is not None:
            includes.append((current, m.group(1)))
            continue
        if line.startswith("#### `"):  # one table may serve several names
            current = {}
            for name in re.findall(r"`([a-z][a-z0-9-]*)`", line):
                tables[name] = current
            continue
        if current is None or not line.startswith("| `"):
            if line.startswith("#"):
                current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        field = cells[0].strip("`")
        current[field] = cells[1]
    for table, name in includes:
        table.update(tables[name])
    return tables


def _scalar_ok(kind: str, value) -> bool:
    return {"string": isinstance(value, str),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "boolean": isinstance(value, bool),
            "map": isinstance(value, dict),
            "any": True}.get(kind, False)


def check_value(tables, type_text: str, value, where: str) -> None:
    """``value`` is of ``type_text``: ``string``, ``integer``, ``number``, ``boolean``,
    ``map`` (free keys), ``any``, ``[name](#name)`` (an object of table ``name``), ``list of
    X``, ``X or null``."""
    options = [t.strip() for t in type_text.split(" or ")]
    if value is None:
        assert "null" in options, f"{where}: null, documented as {type_text}"
        return
    errors = []
    for option in options:
        if option == "null":
            continue
        try:
            check_one(tables, option, value, where)
            return
        except AssertionError as err:  # policy: try the next documented option
            errors.append(str(err))
    raise AssertionError("; ".join(errors) or f"{where}: {value!r} is not {type_text}")


def check_one(tables, option: str, value, where: str) -> None:
    if option.startswith("list of "):
        assert isinstance(value, list), f"{where}: {value!r} is not a list"
        for i, item in enumerate(value):
            check_one(tables, option[len("list of "):], item, f"{where}[{i}]")
        return
    ref = re.fullmatch(r"\[`?([a-z][a-z0-9-]*)`?\]\(#[a-z0-9-]+\)", option)
    if ref:
        check_object(tables, ref.group(1), value, where)
        return
    assert _scalar_ok(option, value), f"{where}: {value!r} is not {option}"


def check_object(tables, name: str, obj, where: str = "") -> None:
    assert name in tables, f"docs/json.md has no table {name!r}"
    assert isinstance(obj, dict), f"{where}: {obj!r} is not an object"
    table = tables[name]
    assert set(obj) == set(table), (f"{where or name}: undocumented {sorted(set(obj) - set(table))}"
                                    f", missing {sorted(set(table) - set(obj))}")
    for key, value in obj.items():
        check_value(tables, table[key], value, f"{where}.{key}")


def no_internal_names(value, where: str = "$") -> None:
    """No ``type`` key anywhere naming a Struct; every ``*_at`` an ISO 8601 time in UTC."""
    if isinstance(value, dict):
        assert not (value.get("type") in STRUCT_NAMES), f"{where}.type = {value['type']}"
        for key, item in value.items():
            if key.endswith("_at") and item is not None:
                assert isinstance(item, str) and item.endswith("Z"), f"{where}.{key} = {item!r}"
                datetime.datetime.fromisoformat(item.replace("Z", "+00:00"))
            no_internal_names(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_internal_names(item, f"{where}[{i}]")


def check_document(doc: dict, kind: str) -> dict:
    """``doc`` is a ``kind`` document exactly as docs/json.md says; kept in
    ``$CKPT_JSON_EXAMPLES`` when set."""
    keep = os.environ.get("CKPT_JSON_EXAMPLES")
    if keep:  # the first of each kind (or event) is kept
        path = Path(keep) / f"{kind}{'-' + doc['event'] if 'event' in doc else ''}.json"
        if not path.exists():
            path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc["version"] == SCHEMA_VERSION and doc["kind"] == kind, doc
    no_internal_names(doc)
    if not os.environ.get("CKPT_JSON_NO_DOC"):
        # an agent's event has one table per event word (``agent-event-heartbeat``...)
        table = f"{kind}-{doc['event'].replace('_', '-')}" if kind == "agent-event" else kind
        check_object(doc_tables(), table, doc, kind)
    return doc


def parsed(out: subprocess.CompletedProcess, kind: str) -> dict:
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout + out.stderr
    return check_document(json.loads(lines[0]), kind)


# ---------------------------------------------------------------- the doc itself


def test_the_doc_parses_and_every_reference_has_its_table():
    tables = doc_tables()
    assert {"status", "operation", "history", "record", "error", "agent-status",
            "agent-prepare", "agent-restore", "agent-rollback", "agent-event-state-changed",
            "agent-event-heartbeat", "agent-event-drain-progress",
            "agent-event-memory-reported", "generation", "load", "keys",
            "fleet-status", "fleet-operation", "fleet-part", "fleet-step",
            "fleet-migration", "drill-report"} <= set(tables)
    for name, table in tables.items():
        assert table, f"table {name} is empty"
        for field, type_text in table.items():
            for ref in re.findall(r"\(#([a-z0-9-]+)\)", type_text):
                assert ref in tables, f"{name}.{field} names {ref}, which has no table"


def doc_examples(text: str | None = None) -> list[tuple[str, list[dict]]]:
    """The ``## Examples`` of docs/json.md: (the line that introduces it, its documents),
    one document per block, or one per line for a stream's lines."""
    text = DOC.read_text() if text is None else text
    found = []
    for m in re.finditer(r"([^\n]+)\n\n```json\n(.*?)\n```", text, re.S):
        body = m.group(2)
        try:
            docs = [json.loads(body)]
        except json.JSONDecodeError:  # policy: a stream's lines, one document each
            docs = [json.loads(line) for line in body.splitlines()]
        found.append((m.group(1), docs))
    return found


def test_the_docs_examples_are_what_they_say():
    """Each example of the doc is a document of its own tables, and an error's exit code is
    the one said above it."""
    examples = doc_examples()
    assert len(examples) >= 5, examples
    for caption, docs in examples:
        for doc in docs:
            check_document(doc, doc["kind"])
            said = re.search(r"\(exit code (\d+)\)", caption)
            if doc["kind"] == "error":
                assert said and int(said.group(1)) == doc["error"]["exit_code"], caption


def test_a_checker_that_finds_nothing_would_be_a_defect():
    tables = doc_tables("#### `t`\n| `a` | integer | x |\n| `b` | [`u`](#u) or null | y |\n"
                        "#### `u`\n| `c` | list of string | z |\n")
    check_object(tables, "t", {"a": 1, "b": {"c": ["x"]}})
    for bad in ({"a": 1}, {"a": "1", "b": None}, {"a": 1, "b": {"c": [1]}},
                {"a": 1, "b": None, "d": 0}):
        with pytest.raises(AssertionError):
            check_object(tables, "t", bad)
    with pytest.raises(AssertionError):
        no_internal_names({"x": [{"type": "StatusReply"}]})
    with pytest.raises(ValueError):
        no_internal_names({"started_at": "yesterdayZ"})


# ---------------------------------------------------------------- the controller


def test_controller_documents(spawn_reference, spawn_controller):
    eng = spawn_reference("js1")
    ctl = spawn_controller(engines_toml(eng))
    write_hook(ctl, "dump", "10-image", 'echo image > "$CKPT_IMAGE_DIR/pages-1.img"')
    status = parsed(ctl.ckptctl("status", "--json"), "status")
    assert status["engines"][0]["status"]["state"] == "running"

    before = ipc_connections(ctl.pid, ctl.endpoint)
    proc = subprocess.Popen(
        [*CKPTCTL, "--controller", ctl.endpoint, "watch",
         "--json", "--duration", "60"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    watch = StreamedLines(proc.stdout)
    try:
        wait_connected(ctl.pid, ctl.endpoint, before)  # watch is there and subscribing
        out = ctl.ckptctl("cycle", "js1", "--json", "--op-id", "js-cycle", "--drain", "keep",
                          "--level", "1")
        op = parsed(out, "operation")
        assert op["operation"] == "cycle" and op["status"] == "succeeded"
        assert op["engines"][0]["phases"][0]["started_at_unix"] >= op["started_at_unix"]
        wait_until(lambda: any('"operation_end"' in line for line in watch.lines),
                   what="the cycle's records on watch --json")
        lines = list(watch.lines)
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(30))
        watch.join()
        proc.stdout.close()
    records = [check_document(json.loads(line), "record") for line in lines]
    assert {"transition", "phase", "operation_start", "operation_end"} <= \
        {r["record_type"] for r in records}
    last = parsed(ctl.ckptctl("status", "--json"), "status")["engines"][0]["last_op"]
    assert last["op_id"] == "js-cycle" and last["operation"] == "cycle", last
    assert last["status"] == "succeeded"
    assert abs(last["started_at_unix"] - op["started_at_unix"]) < 1

    out = ctl.ckptctl("prepare", "js1", "--json", "--op-id", "js-prep", "--tags", "kv_cache")
    assert parsed(out, "operation")["engines"][0]["state"] == "prepared"
    out = ctl.ckptctl("rollback", "js1", "--json", "--reason", "shape test")
    assert parsed(out, "operation")["status"] == "succeeded"

    images = parsed(ctl.ckptctl("images", "list", "--json"), "images")
    assert [(i["image"], i["dumped"], i["kept"]) for i in images["images"]] == [
        ("js-cycle", True, "newest")]
    pruned = parsed(ctl.ckptctl("images", "prune", "--dry-run", "--json"), "images")
    assert pruned["removed"] == [] and pruned["dry_run"] is True
    described = parsed(ctl.ckptctl("describe", "js1", "--json"), "describe")
    assert "js-cycle" in [o["op_id"] for o in described["operations"]]
    assert described["hooks"] == []  # its newest operation, the rollback, ran none
    assert described["images"][0]["image"] == "js-cycle" and described["last_error"] is None

    hist = parsed(ctl.ckptctl("history", "--op-id", "js-cycle", "--json"), "history")
    assert hist["operations"][0]["operation"] == "cycle"
    assert any(r["record_type"] == "transition" for r in hist["records"])

    out = ctl.ckptctl("cycle", "nosuch", "--json")
    assert out.returncode == 2
    err = parsed(out, "error")["error"]
    assert err["kind"] == "UsageError" and err["exit_code"] == 2


def test_error_documents_without_a_peer(ipc_dir):
    out = ckptctl("--controller", f"ipc://{ipc_dir}/none.sock", "status", "--json")
    assert out.returncode == 4
    assert parsed(out, "error")["error"]["kind"] == "UnreachableError"


def test_a_usage_error_with_json_is_an_error_document():
    """A value argparse refuses (NaN, a count out of range, a missing argument) with --json:
    exit 2, argparse's usage on stderr as before, and an error document on stdout (there was
    none: a script reading stdout got nothing)."""
    for argv, names in ((["cycle", "e1", "--deadline", "nan", "--json"], "--deadline"),
                        (["history", "--limit", "0", "--json"], "--limit"),
                        (["agent", "prepare", "--json"], "--control")):
        out = ckptctl(*argv)
        assert out.returncode == 2 and "usage:" in out.stderr, (argv, out.stderr)
        err = parsed(out, "error")["error"]
        assert err["kind"] == "UsageError" and err["exit_code"] == 2, err
        assert names in err["message"], err
    out = ckptctl("cycle", "e1", "--deadline", "nan")
    assert out.returncode == 2 and out.stdout == ""


# ---------------------------------------------------------------- an agent, an engine


def test_agent_documents(spawn_engine):
    eng = spawn_engine("jsa", weights_mib=4, kv_mib=4, step_s=0.01)
    ctl = ["--control", eng.control, "--json"]
    assert parsed(ckptctl("agent", "status", *ctl), "agent-status")["state"] == "running"

    proc = subprocess.Popen(
        [*CKPTCTL, "agent", "watch", *ctl, "--heartbeats",
         "--duration", "60"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    watch = StreamedLines(proc.stdout)
    try:
        wait_until(lambda: any('"heartbeat"' in line for line in watch.lines),
                   what="a heartbeat on agent watch --json")
        prep = parsed(ckptctl("agent", "prepare", *ctl, "--drain", "keep", "--op-id", "a1"),
                      "agent-prepare")
        assert prep["state"] == "prepared" and prep["transitions"][0]["changed_at"]
        rest = parsed(ckptctl("agent", "restore", *ctl, "--op-id", "a2"), "agent-restore")
        assert rest["state"] == "running"
        parsed(ckptctl("agent", "prepare", *ctl, "--op-id", "a3"), "agent-prepare")
        back = parsed(ckptctl("agent", "rollback", *ctl, "--op-id", "a4"), "agent-rollback")
        assert back["state"] == "running"
        wait_until(lambda: any('"state_changed"' in line for line in watch.lines),
                   what="transitions on agent watch --json")
        lines = list(watch.lines)
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(30))
        watch.join()
        proc.stdout.close()
    events = [check_document(json.loads(line), "agent-event") for line in lines]
    assert {"heartbeat", "state_changed"} <= {e["event"] for e in events}


def test_engine_and_keys_documents(spawn_reference, tmp_path):
    eng = spawn_reference("jsg")
    gen = parsed(ckptctl("generate", "--api", eng.api, "--prompt-ids", "1,2,3",
                         "--max-tokens", "4", "--json"), "generation")
    assert len(gen["token_ids"]) == 4 and gen["finish_reason"] == "length"
    load = parsed(ckptctl("load", "--api", eng.api, "--rate", "20", "--duration", "0.5",
                          "--json"), "load")
    assert load["sent"] == 10 and load["error"] is None
    keys = parsed(ckptctl("keys", "jsk", "--dir", str(tmp_path), "--json"), "keys")
    assert Path(keys["public"]).is_file()


def test_image_manifest_document(spawn_reference, tmp_path):
    """``images inspect FOLDER`` reads an image's manifest where it lies (no controller):
    here one written of a live reference engine, as a capture writes it."""
    import os

    from ckpt_controller.controller import manifest

    eng = spawn_reference("jsm")
    folder = tmp_path / "jsm" / "op-9"
    folder.mkdir(parents=True)
    checked, info = manifest.engine_facts(eng.pid, "native", {})
    manifest.write(folder, "jsm", "op-9", checked, info, image_bytes=1)
    doc = parsed(ckptctl("images", "inspect", str(folder), "--json"), "image-manifest")
    assert doc["restores_here"] is True and doc["manifest"]["info"]["pid"] == eng.pid
    assert doc["here"]["kernel"] == os.uname().release


# ---------------------------------------------------------------- the fleet (etcd)


@pytest.mark.fleet
def test_fleet_documents(etcd, ipc_dir):
    """``fleet status``, a fleet operation and ``fleet watch`` of it (a migration's documents
    need CRIU on two nodes: tests/fleet/test_migration.py reads them)."""
    from ckpt_controller.agent import Agent
    from support.config import node_toml
    from support.processes import ControllerProcess

    agent = Agent("jf", control=f"ipc://{ipc_dir}/jf.ctl", heartbeat_interval_s=0.2).start()
    (ipc_dir / "n1").mkdir()
    node = ControllerProcess(ipc_dir / "n1", node_toml(etcd, "n1", [agent]))
    try:
        fleet = ["--etcd", ",".join(etcd.urls), "fleet"]

        def status():
            out = ckptctl(*fleet, "status", "--json")
            doc = json.loads(out.stdout) if out.returncode == 0 else None
            return doc if doc and doc["engines"] else None

        doc = check_document(wait_until(status, what="jf published"), "fleet-status")
        assert doc["engines"][0]["engine"]["engine"] == "jf"
        op = parsed(ckptctl(*fleet, "prepare", "jf", "--op-id", "fj-1", "--json"),
                    "fleet-operation")
        assert op["op"]["operation"] == "prepare" and op["parts"][0]["status"] == "succeeded"
        out = ckptctl(*fleet, "watch", "fj-1", "--json")
        *parts, last = [json.loads(line) for line in out.stdout.splitlines()]
        assert [check_document(p, "fleet-part")["part"]["engine"] for p in parts] == ["jf"]
        assert check_document(last, "fleet-operation")["op"]["status"] == "succeeded"
        parsed(ckptctl(*fleet, "rollback", "jf", "--json"), "fleet-operation")
        doc = wait_until(lambda: (d := status()) and d["engines"][0]["engine"]["state"]
                         == "running" and d, what="jf RUNNING again in etcd")
        check_document(doc, "fleet-status")
    finally:
        node.stop()
        agent.close()
