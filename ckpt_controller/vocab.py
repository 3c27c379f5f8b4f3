"""The project's vocabulary: every state, trigger, mode, reason, level and status, once.

Each word a peer, a journal or an operator can see is a member of one enum here, and every
layer (the lifecycle, the wire Structs, the agent, the controller, the CLI) uses the member,
never a bare string. The wire Structs are typed with these enums, so msgspec refuses a
misspelt value when a frame is decoded, and a value written in one place but not defined here
is a type error. String enums are ``StrEnum``: a member *is* its wire string, so
``DrainMode.WAIT == "wait"`` and JSON/msgpack carry the plain word.

Renamed words stay readable: a journal written before the triggers took the step names
(``prepared``/``restored``, now ``seal``/``resume``) still decodes, through ``_missing_``.

This module imports nothing but ``enum``: anything may import it.
The fleet's words (``FleetKind``, ``PartStatus``, ``MigrationStep``, ``MigrationOutcome``,
``NodeRole``, ``ImageTransport``, ``LimitRule``) are here too: etcd's records are typed with
them, and their JSON words are the values below.

Neighbours: ``lifecycle`` builds its machine from ``CheckpointState`` and ``Trigger``;
``protocol`` types its Structs with these enums; ``controller.policy`` maps ``HookPoint`` to
``HookFailure``; ``fleet.records`` types etcd's records with the fleet's words, and
``fleet.kinds`` is the table of ``FleetKind``.
"""

from __future__ import annotations

import enum


class CheckpointState(enum.StrEnum):
    """Where an engine stands in the checkpoint/restore cycle (wire value: lowercase name)."""

    RUNNING = "running"  # serves requests
    PREPARING = "preparing"  # drains, then releases what a checkpoint must not contain
    PREPARED = "prepared"  # safe to capture
    RESTORING = "restoring"  # brings back what preparing released
    FAILED = "failed"

    @property
    def is_restored(self) -> bool:
        """True when memory may wake and scheduling resume (RUNNING, RESTORING)."""
        return self in (CheckpointState.RUNNING, CheckpointState.RESTORING)


#: States an engine must not be left in: something is working on it.
TRANSITIONAL = frozenset({CheckpointState.PREPARING, CheckpointState.RESTORING})


class Trigger(enum.StrEnum):
    """The verbs that move the lifecycle; ``seal`` and ``resume`` are also the agent's last
    prepare and restore steps, so a step and the transition it makes share one name."""

    PREPARE = "prepare"  # RUNNING -> PREPARING
    SEAL = "seal"  # PREPARING -> PREPARED
    RESTORE = "restore"  # PREPARED or FAILED -> RESTORING
    RESUME = "resume"  # RESTORING -> RUNNING
    ROLLBACK = "rollback"  # PREPARING or PREPARED -> RESTORING
    FAIL = "fail"  # any -> FAILED

    @classmethod
    def _missing_(cls, value: object) -> Trigger | None:
        # policy: names written by older versions (journals, events) still read
        # (anything but a string is simply not a trigger: ValueError, never TypeError)
        return _OLD_TRIGGERS.get(value) if isinstance(value, str) else None


_OLD_TRIGGERS = {"prepared": Trigger.SEAL, "restored": Trigger.RESUME}


class DrainMode(enum.StrEnum):
    """What a prepare does with the requests in flight."""

    WAIT = "wait"  # let them finish (until the drain deadline, then escalate)
    ABORT = "abort"  # end them now with finish reason ``abort``
    KEEP = "keep"  # pause them; they resume after the restore


class Escalation(enum.StrEnum):
    """What a ``wait`` drain does at its deadline."""

    ABORT = "abort"
    KEEP = "keep"
    FAIL = "fail"  # the prepare fails (and rolls back)


class FinishReason(enum.StrEnum):
    """Why a request ended (as OpenAI and vLLM spell it)."""

    STOP = "stop"  # a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted (a drain, a client, a shutdown)
    ERROR = "error"


class ReleaseLevel(enum.IntEnum):
    """How much memory a prepare releases, as vLLM's sleep levels."""

    NOTHING = 0  # release nothing (drain only)
    OFFLOAD = 1  # weights offloaded to host memory, KV cache discarded
    DISCARD = 2  # weights and KV cache discarded; weights reloaded from their file


class PrepareStep(enum.StrEnum):
    """A prepare in one go (``all``) or one step at a time, so hooks can run between."""

    ALL = "all"
    DRAIN = "drain"  # -> PREPARING, requests drained
    RELEASE = "release"  # memory released, still PREPARING
    SEAL = "seal"  # -> PREPARED


class RestoreStep(enum.StrEnum):
    """A restore in one go (``all``) or in two steps, so post-restore hooks run between."""

    ALL = "all"
    REWAKE = "rewake"  # -> RESTORING: memory back and verified, admission closed
    RESUME = "resume"  # -> RUNNING


class MemoryAction(enum.StrEnum):
    RELEASE = "release"
    REWAKE = "rewake"


class OperationKind(enum.StrEnum):
    """What a controller operation does to each engine."""

    PREPARE = "prepare"
    CAPTURE = "capture"  # prepare, then the dump hooks
    RESTORE = "restore"
    CYCLE = "cycle"  # capture, then restore
    ROLLBACK = "rollback"


class OutcomeStatus(enum.StrEnum):
    """How one engine's part of an operation ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"  # never started (an all-or-nothing operation stopped first)
    #: a restarted controller's recovery (or the reconciler) brought the engine of an
    #: interrupted operation back to RUNNING
    RECOVERED = "recovered"


class OperationStatus(enum.StrEnum):
    """How a whole operation ended (``running``: begun and not ended, as the journal and
    ``history`` show an operation in progress or interrupted)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    INTERRUPTED = "interrupted"  # the controller stopped mid-way; recovery settled it


class HookPoint(enum.StrEnum):
    """The moments of a cycle at which the controller runs hooks, in cycle order."""

    PRE_PREPARE = "pre-prepare"
    POST_DRAIN = "post-drain"
    POST_RELEASE = "post-release"
    DUMP = "dump"
    POST_DUMP = "post-dump"
    PRE_RESTORE = "pre-restore"
    POST_RESTORE = "post-restore"
    POST_RESUME = "post-resume"
    ON_FAIL = "on-fail"


class HookFailure(enum.StrEnum):
    """What a hook's non-zero exit or timeout does at its point."""

    VETO = "veto"  # the operation is refused where it stands: nothing moved, or nothing is left to move
    ROLLBACK = "rollback"  # the engine is rolled back to RUNNING (if its process lives)
    FAIL = "fail"  # the engine is marked FAILED
    LOG = "log"  # logged and counted; the operation goes on


class HookCondition(enum.StrEnum):
    """What else holds when a hook point runs: the second key of the hook-failure table
    (``controller.policy.HOOK_FAILURE``), beside the point; journaled with a failure."""

    PLAIN = "plain"  # the point in its place in the cycle
    #: pre-restore hooks run with ``CKPT_UNDO_CAPTURE=1`` after a failed dump or post-dump,
    #: to give back what the dump hooks took (a GPU that cuda-checkpoint locked)
    UNDOING_CAPTURE = "undoing-capture"
    #: the engine's process is gone: a dump that ended it, or a restore whose pre-restore
    #: hooks are to bring it back from its image (a stop-mode dump, a migration)
    NO_PROCESS = "no-process"
    #: the fleet's check that this node may admit an engine a migration brought here
    #: (``EngineSession.before_resume``), at the post-restore moment: after re-wake, before
    #: re-admission (or before a reconciler settles the engine)
    TAKING_OVER = "taking-over"


class EngineKind(enum.StrEnum):
    """What serves behind an engine's agent (the ``kind`` of a config's ``[[engine]]``)."""

    NATIVE = "native"  # the reference engine, or any engine with the agent built in
    VLLM = "vllm"  # a vLLM server, through its sidecar agent


class EngineApi(enum.StrEnum):
    """How an agent drives its engine (``status``'s ``api``)."""

    EMBEDDED = "embedded"  # the agent runs inside the engine (the reference engine)
    VLLM_CHECKPOINT = "vllm-checkpoint"  # vLLM 0.34+'s /checkpoint/prepare|restore|status
    VLLM_DEV = "vllm-dev"  # vLLM's dev-mode API (/pause, /sleep, /wake_up, /collective_rpc)


class RecoverUncaptured(enum.StrEnum):
    """What the controller does with an engine an interrupted operation never began to capture
    and that it finds FAILED (``recover_uncaptured`` in the config)."""

    RESUME = "resume"  # restore it to RUNNING
    LEAVE = "leave"  # leave it FAILED for a person to look at


class RosterChange(enum.StrEnum):
    """How an engine joined or left a controller outside its TOML (the journal's ``roster``
    table; a migration between nodes makes both)."""

    ADOPTED = "adopted"  # the controller drives it from now on (it came from another node)
    GIVEN_AWAY = "given_away"  # the controller no longer drives it: it lives on another node


# ---------------------------------------------------------------- the fleet (docs/fleet.md)

class FleetKind(enum.StrEnum):
    """What a fleet operation does (``ckptctl fleet KIND``); ``fleet.kinds`` says, for each,
    how it runs. The per-engine kinds share their words with ``OperationKind``: each engine's
    part is that node-local operation."""

    PREPARE = "prepare"
    CAPTURE = "capture"
    RESTORE = "restore"
    CYCLE = "cycle"
    ROLLBACK = "rollback"
    MIGRATE = "migrate"  # one engine to another node, in ``MigrationStep``s

    @property
    def local(self) -> OperationKind | None:
        """The node-local operation each engine's part is (None: not per-engine parts)."""
        try:
            return OperationKind(self.value)
        except ValueError:  # policy: a kind of the fleet's own (migrate) has no local twin
            return None


class PartStatus(enum.StrEnum):
    """Where one engine's part of a fleet operation stands (also how a migration step
    ended: succeeded, failed or lost)."""

    PENDING = "pending"  # not started yet
    STARTED = "started"  # in its node's inbox, running there
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"  # its node died (its lease expired) while it ran
    SKIPPED = "skipped"  # never started: the operation stopped at a failure

    @property
    def ended(self) -> bool:
        return self not in (PartStatus.PENDING, PartStatus.STARTED)


class MigrationStep(enum.StrEnum):
    """The steps of a migration, each run on one node (``fleet.migration``)."""

    RECEIVE = "receive"  # target: the image folder (and the page server)
    SEND = "send"  # source: prepare, capture (dump, left stopped), the small files
    ADOPT = "adopt"  # target: the engine adopted and restored, then taken over
    FINISH = "finish"  # source: the stopped copy ended, the engine given away
    RESUME = "resume"  # source: the engine continued and restored (it did not move)
    ABANDON = "abandon"  # target: what a failed send left there removed

    @property
    def runs_on(self) -> NodeRole:
        return NodeRole.TARGET if self in _ON_TARGET else NodeRole.SOURCE


class NodeRole(enum.StrEnum):
    """A node's side of a migration."""

    SOURCE = "source"
    TARGET = "target"


_ON_TARGET = frozenset({MigrationStep.RECEIVE, MigrationStep.ADOPT, MigrationStep.ABANDON})


class MigrationOutcome(enum.StrEnum):
    """How a migration ended (``running`` until it has)."""

    RUNNING = "running"
    MOVED = "moved"  # RUNNING on the target
    STAYED = "stayed"  # RUNNING on the source
    LOST = "lost"  # the engine died on the way
    FAILED = "failed"  # not RUNNING for now: its error says where, and what the nodes do


class ImageTransport(enum.StrEnum):
    """How a migrating engine's image reaches its target (the target's ``[migration]``)."""

    PAGE_SERVER = "page-server"  # pages streamed into the target's ``criu page-server``
    SHARED = "shared"  # dumped into a folder both nodes see


class LimitRule(enum.StrEnum):
    """How a fleet kind counts against ``--max-unavailable`` (``fleet.kinds``)."""

    NONE = "none"  # its parts take no engine out of service
    HOLDS_ALL = "holds-all"  # every engine it names stays out until restored (prepare)
    ROLLING = "rolling"  # each part takes its engine out and brings it back (cycle, migrate)
