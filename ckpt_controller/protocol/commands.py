"""The wire's constants, the request and reply type bytes, and the commands a client sends
(an agent's and the controller's). Command fields carry their limits (``values``) and words
(``vocab``), so a frame with NaN, an empty op id or a misspelt mode is refused when decoded.
Neighbours: ``results`` and ``events`` (what comes back), ``codec`` (frames), ``values``,
``vocab``; the package's docstring has the framing and the evolution rules.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from ckpt_controller.values import (
    ByteSize,
    Count,
    Duration,
    DurationOrZero,
    HookEnv,
    Names,
    OpId,
    Percent,
    StepOpId,
    Tags,
    Text,
)
from ckpt_controller.vocab import (
    DrainMode,
    Escalation,
    OperationKind,
    PrepareStep,
    ReleaseLevel,
    RestoreStep,
)


PROTOCOL_VERSION = 2
#: A frame larger than this is refused with a ``ProtocolError`` reply.
MAX_PAYLOAD_BYTES = 1 << 20
#: zmq drops (and disconnects) anything larger than this before we see it.
HARD_MAX_MESSAGE_BYTES = 16 << 20
#: the most operations or records one history request returns
MAX_HISTORY_LIMIT = 100_000


class RequestType(bytes, enum.Enum):
    """First frame of a message from a client."""

    HANDSHAKE = b"\x00"
    STATUS = b"\x01"
    PREPARE = b"\x02"
    RESTORE = b"\x03"
    ROLLBACK = b"\x04"
    HEARTBEAT = b"\x05"
    SUBSCRIBE = b"\x06"
    UNSUBSCRIBE = b"\x07"
    FAIL = b"\x08"
    # served by the controller only
    OPERATION = b"\x10"
    HISTORY = b"\x11"
    COMPACT = b"\x12"
    IMAGES = b"\x13"


class ReplyType(bytes, enum.Enum):
    """First frame of a message from the agent."""

    REPLY = b"\x80"
    ERROR = b"\x81"
    EVENT = b"\x82"


#: What a handshake or a heartbeat says its server is in: an agent's ``CheckpointState``, or
#: ``serving`` from the controller (and any ``rpcserver`` without a lifecycle). A plain string:
#: msgspec takes one string type per field, and ``serving`` is no engine state.
ServerState = str



# ---------------------------------------------------------------- commands (client -> agent)


class Command(msgspec.Struct, kw_only=True):
    """Fields every command starts with."""

    call_id: int
    version: int = PROTOCOL_VERSION


class Handshake(Command, kw_only=True):
    client: Text = ""


class StatusCommand(Command, kw_only=True):
    #: controller only: these engines (empty: all)
    engines: Names = []


class HeartbeatCommand(Command, kw_only=True):
    pass


class SubscribeCommand(Command, kw_only=True):
    pass


class PrepareCommand(Command, kw_only=True):
    """Drain, then release memory. ``level`` or ``tags`` (not both) say what to release."""

    op_id: StepOpId
    drain: DrainMode = DrainMode.WAIT
    #: 0: the drain deadline is now (a wait drain escalates at once)
    drain_timeout_s: DurationOrZero = 30.0
    on_deadline: Escalation = Escalation.ABORT
    level: ReleaseLevel | None = ReleaseLevel.OFFLOAD
    tags: Tags | None = None
    residual_budget_bytes: ByteSize | None = None
    deadline_s: Duration | None = None
    #: with ``step="all"``: the release's own limit, counted from the end of the drain
    release_deadline_s: Duration | None = None
    #: all: drain, release, PREPARED in one go. Or one step at a time, so a controller can run
    #: hooks between them: drain (-> stays PREPARING), release (stays PREPARING), seal
    #: (-> PREPARED). A failure in any step rolls back to RUNNING.
    step: PrepareStep = PrepareStep.ALL


class RestoreCommand(Command, kw_only=True):
    """Re-wake what was released, verify, resume scheduling, re-open admission."""

    op_id: StepOpId
    deadline_s: Duration | None = None
    #: all; or rewake (-> RESTORING: memory back and verified, admission still closed) and
    #: then resume (-> RUNNING), so post-restore hooks can check the engine in between
    step: RestoreStep = RestoreStep.ALL


class RollbackCommand(Command, kw_only=True):
    """Return a PREPARING or PREPARED engine to RUNNING (same path as restore)."""

    op_id: StepOpId
    reason: Text = ""
    deadline_s: Duration | None = None


class FailCommand(Command, kw_only=True):
    """Mark the engine FAILED (e.g. a capture left it unusable)."""

    op_id: StepOpId
    reason: Text = ""


class OperationCommand(Command, kw_only=True):
    """Controller: run one operation on some engines (empty list: all configured engines).

    Prepare parameters left ``None`` take the engine's configured defaults."""

    #: names the operation's image folders: see ``values.OP_ID_PATTERN``
    op_id: OpId
    kind: OperationKind
    engines: Names = []
    drain: DrainMode | None = None
    drain_timeout_s: Duration | None = None
    on_deadline: Escalation | None = None
    level: ReleaseLevel | None = None
    tags: Tags | None = None
    residual_budget_bytes: ByteSize | None = None
    #: overall deadline per engine (default: the configured operation deadline)
    deadline_s: Duration | None = None
    #: cycle: at most this many engines out of service at once, or this percent of them
    #: (rounded down, at least one); neither: ``values.DEFAULT_MAX_UNAVAILABLE`` (25%)
    max_unavailable: Count | None = None
    max_unavailable_percent: Percent | None = None
    #: prepare: if one engine fails, roll back the others
    all_or_nothing: bool = True
    reason: Text = ""
    #: restore: the operation (id) whose image to restore, named explicitly; needed for an
    #: image older than the engine's generation (default: the image of this generation)
    image: OpId | None = None
    #: settings for this operation's hooks, added to their environment (``values.HookEnv``:
    #: a fleet migration's stop-and-stay dump into the target's page server, its restore
    #: beside the stopped original)
    hook_env: HookEnv = {}
    #: restore: the engines' processes are known not to run here (a migration's adopt: the
    #: engine comes from its image), so none is asked its status first (a refused connection
    #: took half a second to tell); their pre-restore hooks bring them back
    absent: bool = False
    #: restore: the fields of the image's manifest an operator accepts differing here
    #: (``controller.manifest.CHECKED``: kernel, criu, cpu, ...)
    accept: Annotated[list[Text], Meta(max_length=32)] = []


class HistoryCommand(Command, kw_only=True):
    engine: Text | None = None
    op_id: Text | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_HISTORY_LIMIT)] = 50


class ImagesCommand(Command, kw_only=True):
    """The capture images on disk of ``engines`` (none named: every engine's folder there;
    ``ckptctl images list``); with ``prune``, remove those retention does not keep
    (``keep``: the newest good images each keeps, default ``[images] keep``; ``dry_run``:
    say what would go, remove nothing)."""

    engines: Names = []
    prune: bool = False
    keep: Count | None = None
    dry_run: bool = False


class CompactCommand(Command, kw_only=True):
    """Compact the controller's journal now (``[journal]``'s bounds; ``ckptctl journal
    compact``)."""
