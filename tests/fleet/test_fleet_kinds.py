"""The table of fleet kinds (``fleet.kinds.KINDS``) is the one place a kind is described: every
kind has a row, every row's driver and options have their code, ``ckptctl fleet`` offers what
the rows say, and nothing outside the table dispatches on a kind by name."""

from __future__ import annotations

import ast

import pytest

from ckpt_controller.fleet import drivers
from ckpt_controller.fleet.kinds import KINDS, Drive, Option, spec
from ckpt_controller.vocab import FleetKind, LimitRule
from support import ROOT
from support.cli import ckptctl


def test_every_kind_has_a_row_and_every_row_its_code():
    from ckpt_controller.cli.fleet_cmd import OPTIONS, RUNS

    assert list(KINDS) == list(FleetKind)
    assert set(OPTIONS) == set(Option)
    for drive in Drive:
        assert drive in drivers.COORDINATOR and drive in drivers.SUBMIT and drive in RUNS
    for row in KINDS.values():
        # a parts kind runs one node-local operation per engine; a kind that takes engines
        # out says how the limit counts them
        assert (row.drive is Drive.PARTS) == (row.local is not None), row.kind
        assert row.takes_out == (row.limit is not LimitRule.NONE)
    assert spec("cycle") is KINDS[FleetKind.CYCLE]
    with pytest.raises(ValueError):
        spec("teleport")


def _options(kind: FleetKind) -> set[str]:
    """The flags ``ckptctl fleet KIND --help`` lists."""
    out = ckptctl("fleet", kind, "--help")
    assert out.returncode == 0, out.stderr
    return {word.strip("[],") for word in out.stdout.split() if word.startswith(("--", "[--"))}


@pytest.mark.parametrize("kind", list(FleetKind))
def test_the_cli_offers_what_the_row_says(kind):
    row = KINDS[kind]
    flags = _options(kind)
    assert {"--op-id", "--deadline", "--json"} <= flags
    assert ("--max-unavailable" in flags) == (Option.MAX_UNAVAILABLE in row.options)
    assert ("--selector" in flags) == (Option.SELECT in row.options)
    assert ("--to" in flags) == (Option.ONE_ENGINE_TO in row.options)
    assert ("--on-deadline" in flags) == (Option.PREPARE in row.options)
    assert ("--reason" in flags) == (Option.REASON in row.options)
    assert ("--image" in flags) == (Option.IMAGE in row.options)


def test_nothing_outside_the_table_names_a_fleet_kind():
    """Dispatch goes through the table: ``FleetKind.X`` appears only where the words are
    made (``vocab``), in the table (``fleet.kinds``), and in ``fleet.records``, which reads
    the inbox an earlier version wrote (its kind said ``migrate-<step>``)."""
    allowed = {"vocab.py", "fleet/kinds.py", "fleet/records.py"}
    found = []
    for path in sorted((ROOT / "ckpt_controller").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "ckpt_controller"))
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "FleetKind":
                found.append(f"{rel}:{node.lineno}: FleetKind.{node.attr}")
    assert found == []
