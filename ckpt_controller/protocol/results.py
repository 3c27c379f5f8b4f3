"""What comes back for a command: an agent's results (drain, memory and transition
records, status), the controller's (operation results, engine views, history), the ``Result``
union a ``Reply`` carries, and ``ErrorReply`` (a typed error from ``errors``).
Neighbours: ``commands``, ``events`` (records sent unasked), ``codec``, ``lifecycle``
(``Transition``, which ``TransitionRecord.of`` puts on the wire).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from ckpt_controller.errors import CkptError, from_wire
from ckpt_controller.vocab import (
    CheckpointState,
    DrainMode,
    EngineApi,
    Escalation,
    HookPoint,
    MemoryAction,
    OperationKind,
    OperationStatus,
    OutcomeStatus,
    ReleaseLevel,
    Trigger,
)

from ckpt_controller.protocol.commands import ServerState

if TYPE_CHECKING:  # read by name only: importing the protocol loads no lifecycle machine
    from ckpt_controller.lifecycle import Transition

# ---------------------------------------------------------------- results (agent -> client)


class DrainReport(msgspec.Struct, kw_only=True):
    mode: DrainMode
    escalated_to: Escalation | None = None
    in_flight_at_start: int = 0
    completed: int = 0
    aborted: int = 0
    kept: int = 0
    drain_s: float = 0.0


class DeviceMemory(msgspec.Struct, kw_only=True):
    """One device's numbers. CPU: process RSS. CUDA: torch allocator and ``mem_get_info``."""

    device: str
    before_bytes: int
    after_bytes: int
    freed_bytes: int
    #: memory this process still holds on the device after the step
    residual_bytes: int
    note: str = ""


class MemoryReport(msgspec.Struct, kw_only=True):
    """What a release or re-wake did. ``tensor_bytes`` is what the registry moved."""

    action: MemoryAction
    level: ReleaseLevel | None = None
    tags: list[str] = []
    tensor_bytes: int = 0
    offloaded_bytes: int = 0
    discarded_bytes: int = 0
    freed_bytes: int = 0
    residual_bytes: int = 0
    budget_bytes: int | None = None
    devices: list[DeviceMemory] = []
    verified_tensors: int = 0
    duration_s: float = 0.0


class TransitionRecord(msgspec.Struct, kw_only=True):
    """A ``lifecycle.Transition`` on the wire: the same fields in the same order; ``of`` is the
    one conversion. Two classes, not one, because the lifecycle sits below the protocol (it
    must not import it, and the wire's Structs live here), while the protocol must not load
    the lifecycle's machine (``transitions``) for every client that only reads records."""

    #: an old peer's or journal's ``prepared``/``restored`` reads as ``seal``/``resume``
    trigger: Trigger
    source: CheckpointState
    dest: CheckpointState
    generation: int
    monotonic: float
    wall: float
    reason: str = ""

    @classmethod
    def of(cls, t: Transition) -> TransitionRecord:
        """The record of the lifecycle's move ``t``, as peers and journals read it."""
        return cls(trigger=t.trigger, source=t.source, dest=t.dest, generation=t.generation,
                   monotonic=t.monotonic, wall=t.wall, reason=t.reason)


class HandshakeReply(msgspec.Struct, kw_only=True, tag=True):
    protocol_version: int
    engine: str
    pid: int
    incarnation: int
    #: see ``ServerState``
    state: ServerState
    #: how often the agent sends heartbeats to subscribers
    heartbeat_interval_s: float = 0.0


class StatusReply(msgspec.Struct, kw_only=True, tag=True):
    engine: str
    #: the engine's PID as the host sees it (also when it runs in a PID namespace of its own)
    pid: int
    state: CheckpointState
    is_restored: bool
    generation: int
    in_flight: int
    kept: int
    released_tags: list[str]
    registered_bytes: dict[str, int]
    #: how many times this process was found restored from a checkpoint image
    incarnation: int
    restored_from_image: bool
    current_op: str | None = None
    last_transition: TransitionRecord | None = None
    #: where the engine is reached, as it bound them: ``control`` (its agent), ``api`` (the
    #: reference engine's requests), ``http`` (a vLLM server); a wildcard host (0.0.0.0, *,
    #: ::) is left as it is: a fleet node publishes its own address in its place
    endpoints: dict[str, str] = {}
    #: tag -> the file a level-2 re-wake reads it back from (``MemoryManager.reload_files``)
    reload_files: dict[str, str] = {}
    #: how the agent drives its engine (None: an agent older than this field)
    api: EngineApi | None = None
    #: more of it, as a person reads it (the engine's version, a second API and what for)
    api_detail: str | None = None
    #: the level of the release in force (2: a re-wake reads ``reload_files``); None:
    #: nothing released, tags named, or an agent that does not say
    released_level: ReleaseLevel | None = None


class PrepareReply(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    state: CheckpointState
    drain: DrainReport
    memory: MemoryReport
    duration_s: float
    #: the transitions this operation made (events can be lost; a reply is not)
    transitions: list[TransitionRecord] = []


class RestoreReply(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    state: CheckpointState
    generation: int
    memory: MemoryReport | None
    duration_s: float
    resumed_kept: int = 0
    #: the transitions this operation made (events can be lost; a reply is not)
    transitions: list[TransitionRecord] = []


class HeartbeatReply(msgspec.Struct, kw_only=True, tag=True):
    #: see ``ServerState``
    state: ServerState
    seq: int
    monotonic: float


class Ack(msgspec.Struct, kw_only=True, tag=True):
    pass


# ---------------------------------------------------------------- controller results


class ErrorInfo(msgspec.Struct, kw_only=True):
    kind: str
    message: str
    details: dict[str, Any] = {}

    def to_exception(self) -> CkptError:
        return from_wire(self.kind, self.message, self.details)


class PhaseRecord(msgspec.Struct, kw_only=True):
    name: str
    wall: float
    duration_s: float
    ok: bool = True


class HookRun(msgspec.Struct, kw_only=True):
    point: HookPoint
    path: str
    exit_code: int | None
    duration_s: float
    timed_out: bool = False
    stdout_tail: str = ""
    stderr_tail: str = ""


class EngineOutcome(msgspec.Struct, kw_only=True):
    engine: str
    status: OutcomeStatus
    state: CheckpointState | None = None
    phases: list[PhaseRecord] = []
    drain: DrainReport | None = None
    released: MemoryReport | None = None
    rewoken: MemoryReport | None = None
    hooks: list[HookRun] = []
    error: ErrorInfo | None = None
    generation: int | None = None
    #: capture: whether a dump hook ran (False: nothing was captured); None for other steps
    dumped: bool | None = None
    #: the image (the id of the operation that dumped it) this capture made or this
    #: restore restored; None when there is none
    image: str | None = None


class OperationResult(msgspec.Struct, kw_only=True, tag=True):
    op_id: str
    kind: OperationKind
    status: OperationStatus
    engines: list[EngineOutcome]
    wall: float
    duration_s: float
    error: ErrorInfo | None = None
    max_unavailable_seen: int = 0


class LastOperation(msgspec.Struct, kw_only=True):
    """The newest operation on one engine in the controller's journal (``EngineView``'s
    ``last_op``): what ``ckptctl status`` shows as LAST-OP without a request per engine."""

    op_id: str
    kind: OperationKind
    #: ``running`` while the operation is in progress
    status: OperationStatus
    #: when it started
    wall: float
    duration_s: float | None = None


class EngineView(msgspec.Struct, kw_only=True):
    """The controller's view of one engine: the agent's own status when it answered."""

    engine: str
    kind: str
    control: str
    reachable: bool
    status: StatusReply | None = None
    holder: str | None = None
    error: ErrorInfo | None = None
    #: the operation that lost contact with this engine, until the reconciler settles it
    unsettled_by: str | None = None
    #: an engine the controller gave away: the node it lives on now, and the operation that
    #: moved it there (the controller no longer drives it: it is not probed)
    moved_to: str | None = None
    moved_by: str | None = None
    #: the newest operation on it in the journal (None: none there)
    last_op: LastOperation | None = None
    #: bytes its capture images take on disk (``<image_dir>/<engine>``); None: not counted
    images_bytes: int | None = None


class ControllerStatusReply(msgspec.Struct, kw_only=True, tag=True):
    controller_pid: int
    engines: list[EngineView]
    #: the controller filled each view's ``last_op`` (one of before this field was added
    #: leaves it False, and a client asks ``history`` per engine instead)
    last_ops: bool = False


class OperationSummary(msgspec.Struct, kw_only=True):
    op_id: str
    kind: OperationKind
    engines: list[str]
    #: ``running`` while the operation is in progress
    status: OperationStatus
    wall: float
    duration_s: float | None = None


class JournalRecord(msgspec.Struct, kw_only=True):
    seq: int
    op_id: str | None
    engine: str | None
    type: str
    wall: float
    monotonic: float
    data: dict[str, Any] = {}


class HistoryReply(msgspec.Struct, kw_only=True, tag=True):
    operations: list[OperationSummary]
    records: list[JournalRecord]


class ImageInfo(msgspec.Struct, kw_only=True):
    """One operation's image folder of one engine (``<image_dir>/<engine>/<image>``)."""

    engine: str
    #: the folder's name: the id of the operation whose hooks made it
    image: str
    bytes: int
    #: when it last changed (Unix time)
    wall: float
    #: a capture dumped it: an image a restore can use (else what a failed one left)
    dumped: bool
    #: why retention keeps it (``newest``, ``latest``, ``in use``, ``last attempt``); None: a
    #: prune removes it
    kept: str | None = None


class ImagesReply(msgspec.Struct, kw_only=True, tag=True):
    """The images on disk (after a prune: those that stayed), what a prune removed (or with
    ``dry_run`` would remove), and the ``keep`` it kept to."""

    images: list[ImageInfo]
    removed: list[ImageInfo] = []
    keep: int
    dry_run: bool = False
    #: where they are: ``<image_dir>/<engine>/<image>`` (None: a controller older than this)
    image_dir: str | None = None


class CompactReply(msgspec.Struct, kw_only=True, tag=True):
    """What one compaction of the journal forgot, and the bounds it kept to."""

    operations: int
    records: int
    keep_days: float
    keep_operations: int
    duration_s: float


Result = (HandshakeReply | StatusReply | PrepareReply | RestoreReply | HeartbeatReply | Ack
          | OperationResult | ControllerStatusReply | HistoryReply | CompactReply
          | ImagesReply)


class Reply(msgspec.Struct, kw_only=True):
    call_id: int
    result: Result


class ErrorReply(msgspec.Struct, kw_only=True):
    """A typed error; ``kind`` is a class name from ``ckpt_controller.errors``."""

    call_id: int
    kind: str
    message: str
    details: dict[str, Any] = {}

    def to_exception(self) -> CkptError:
        return from_wire(self.kind, self.message, self.details)
