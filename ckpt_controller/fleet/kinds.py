"""The table of fleet kinds: what each ``ckptctl fleet KIND`` is, in one place.

Every kind is one row (``KindSpec``): its help, how it counts against ``--max-unavailable``
(``LimitRule``), which driver runs it (``Drive``: per-engine parts, each a node-local
operation on the engine's own node, or a migration's steps on two nodes), the node-local
operation a part runs, and the options ``ckptctl fleet KIND`` takes. The coordinator, the
node and the CLI dispatch through it (``drivers`` maps each ``Drive`` to its code); none
of them names a kind. Adding a kind that runs as per-engine parts is one row here; a kind
that needs a new way to run is a row plus its driver (docs/fleet.md, "Adding a fleet kind").

This module is data: it imports only the vocabulary, so every fleet module may read it.
Neighbours: ``vocab`` (``FleetKind``, ``LimitRule``, ``OperationKind``), ``drivers``,
``coordinator``, ``node``, ``cli.fleet_cmd``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ckpt_controller.vocab import FleetKind, LimitRule, OperationKind


class Drive(enum.Enum):
    """How a fleet kind runs (``drivers`` has the code of each)."""

    PARTS = "parts"  # one part per engine, each a node-local operation on its own node
    STEPS = "steps"  # a migration: steps on the source and the target, one at a time


class Option(enum.Enum):
    """The options a ``ckptctl fleet KIND`` takes (``cli.fleet_cmd`` builds them)."""

    SELECT = "select"  # ENGINE... | --all | --selector KEY=VALUE
    ONE_ENGINE_TO = "one-engine-to"  # ENGINE --to NODE
    MAX_UNAVAILABLE = "max-unavailable"  # --max-unavailable N|P%
    PREPARE = "prepare"  # --drain --drain-timeout --on-deadline --level|--tags --budget
    DRAIN = "drain"  # --drain --drain-timeout --level (a migration's prepare)
    REASON = "reason"  # --reason (rollback)
    IMAGE = "image"  # --image OP_ID (restore)


@dataclass(frozen=True)
class KindSpec:
    kind: FleetKind
    help: str
    limit: LimitRule
    drive: Drive
    options: tuple[Option, ...]
    #: the node-local operation each engine's part runs (``Drive.PARTS``)
    local: OperationKind | None = None

    @property
    def takes_out(self) -> bool:
        """Whether its parts take engines out of service (what the limit counts)."""
        return self.limit is not LimitRule.NONE


_PARTS = (Option.SELECT, Option.MAX_UNAVAILABLE)

#: the fleet's kinds, in the order ``ckptctl fleet --help`` lists them
KINDS: dict[FleetKind, KindSpec] = {spec.kind: spec for spec in (
    KindSpec(FleetKind.PREPARE, "drain and release engines across nodes (they stay out of "
             "service, counted by --max-unavailable, until restored or rolled back)",
             LimitRule.HOLDS_ALL, Drive.PARTS, (*_PARTS, Option.PREPARE),
             OperationKind.PREPARE),
    KindSpec(FleetKind.CAPTURE, "run the dump hooks on PREPARED engines, each on its node",
             LimitRule.NONE, Drive.PARTS, _PARTS, OperationKind.CAPTURE),
    KindSpec(FleetKind.RESTORE, "re-wake PREPARED (or FAILED) engines, each on its node",
             LimitRule.NONE, Drive.PARTS, (*_PARTS, Option.IMAGE), OperationKind.RESTORE),
    KindSpec(FleetKind.CYCLE, "prepare, capture and restore, rolling across the fleet under "
             "--max-unavailable", LimitRule.ROLLING, Drive.PARTS, (*_PARTS, Option.PREPARE),
             OperationKind.CYCLE),
    KindSpec(FleetKind.ROLLBACK, "return PREPARED engines to RUNNING, each on its node",
             LimitRule.NONE, Drive.PARTS, (*_PARTS, Option.REASON), OperationKind.ROLLBACK),
    KindSpec(FleetKind.MIGRATE, "move a RUNNING engine to another node with CRIU "
             "(docs/fleet.md, Migration)", LimitRule.ROLLING, Drive.STEPS,
             (Option.ONE_ENGINE_TO, Option.DRAIN)),
)}


def spec(kind: FleetKind | str) -> KindSpec:
    """The row of ``kind``; ``ValueError`` for a word that is no fleet kind."""
    return KINDS[FleetKind(kind)]
