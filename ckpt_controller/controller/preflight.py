"""What an operation checks before it exists: every engine asked, a restore's image chosen.

``ask`` reads each engine's status, from its link when the link heard from the agent in the
last ``links.KNOWN_FRESH_S`` (its replies, events and heartbeats keep it current), else by one
status request to the agent (concurrently, one try each, answered within ``[deadlines] probe``:
2 s unless configured longer for busy engines on loaded hosts), and refuses the whole operation
if any engine does not answer or is not in a state the operation needs (``NEEDS``), so a group
with one dead engine takes none out of service (one that died within that last second is found
by the operation itself, as one that dies just after a status request is). A restore may go to
an engine that does not answer when pre-restore hooks are installed: they may bring its process
back from an image; one whose command says its process is ``absent`` (a migration's adopt) is
not asked at all. ``choose_images`` gives a restore the image of each engine: the one the
operator named, else the newest one a capture dumped at the engine's generation; an older one
must be named; ``check_images`` refuses one whose manifest records what this host differs in
(``manifest``). A refusal here raises, and the controller turns it into a refused request:
nothing journaled, counted as refused. Neighbours: ``service`` calls both before it journals an
operation; ``journal`` (the capture records); ``hooks`` (which points have hooks).
"""

from __future__ import annotations

from ckpt_controller import hub
from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.controller.hooks import find_hooks
from ckpt_controller.controller.links import KNOWN_FRESH_S, AgentLink
from ckpt_controller.controller.journal import Journal
from ckpt_controller.errors import CkptError, UnreachableError, UsageError
from ckpt_controller.vocab import CheckpointState, HookPoint, OperationKind

#: the states an operation needs every one of its engines in, checked before it touches any
NEEDS: dict[OperationKind, tuple[CheckpointState, ...]] = {
    OperationKind.PREPARE: (CheckpointState.RUNNING,),
    OperationKind.CYCLE: (CheckpointState.RUNNING,),
    OperationKind.CAPTURE: (CheckpointState.PREPARED,),
    OperationKind.RESTORE: (CheckpointState.PREPARED, CheckpointState.FAILED),
    OperationKind.ROLLBACK: (CheckpointState.PREPARING, CheckpointState.PREPARED),
}


def probe(config: ControllerConfig, name: str, link: AgentLink | None = None
          ) -> p.StatusReply:
    """Engine ``name``'s status: what ``link`` (an open connection of the operation's) knows
    when it heard from the agent in the last ``KNOWN_FRESH_S``, else asked once over ``link``
    or, without one, over a new connection; raises the ``CkptError`` of a failure to ask
    (``UnreachableError`` when it does not answer within ``[deadlines] probe``). One quick
    status request, one try: a probe never holds an engine or waits out retries."""
    timeout_s = config.deadlines.probe
    if link is not None:
        return link.knows(KNOWN_FRESH_S) or link.status(timeout_s=timeout_s, retries=0)
    with AgentClient(config.engine(name).control, timeout_s=timeout_s, retries=0,
                     curve=config.agent_curve(name)) as c:
        return c.status()


def ask(config: ControllerConfig, cmd: p.OperationCommand, engines: list[str],
        links: dict[str, AgentLink] | None = None) -> dict[str, p.StatusReply | None]:
    """Each engine's status (None: a restore's engine that may be revived), asked over its
    link in ``links`` when there is one. Raises for the first engine that refuses the
    operation, naming every one in ``details['refused']``."""
    links = links or {}
    needs = NEEDS[cmd.kind]
    revive = cmd.kind == OperationKind.RESTORE and bool(find_hooks(config.hooks_dir,
                                                                   HookPoint.PRE_RESTORE))
    if config.require_dump and cmd.kind in (OperationKind.CAPTURE, OperationKind.CYCLE) \
            and not find_hooks(config.hooks_dir, HookPoint.DUMP):
        raise UsageError(f"no dump hook is installed (in {config.hooks_dir}/dump) and "
                         "[controller] require_dump = true: a capture would capture nothing",
                         hooks_dir=str(config.hooks_dir))
    statuses: dict[str, p.StatusReply | None] = {}

    def look(name: str) -> CkptError | None:
        if revive and cmd.absent:  # known not to run here: its hooks bring it back
            statuses[name] = None
            return None
        try:
            status = statuses[name] = probe(config, name, links.get(name))
        except UnreachableError as err:  # policy: unreachable refuses, unless revivable
            if revive:
                statuses[name] = None
                return None
            return UnreachableError(f"{name} did not answer: {err.message}",
                                    **{**err.details, "engine": name})
        except CkptError as err:  # policy: any other failure to ask refuses too
            return err
        if status.state in needs:
            return None
        return UsageError(f"{cmd.kind} needs {' or '.join(s.upper() for s in needs)} "
                          f"engines; {name} is {status.state}", engine=name,
                          state=status.state, needs=list(needs))

    answers: dict[str, CkptError | None] = {}
    hub.each(lambda name: answers.__setitem__(name, look(name)), engines, len(engines))
    problems = [(n, answers[n]) for n in engines if answers[n]]
    if problems:
        first = problems[0][1]
        first.details["refused"] = {n: e.message for n, e in problems}
        raise first
    return statuses


def choose_images(config: ControllerConfig, journal: Journal, cmd: p.OperationCommand,
                  statuses: dict[str, p.StatusReply | None]) -> dict[str, str | None]:
    """The image (an operation id) each engine of a restore gets: the one ``cmd.image``
    names, else the newest one its captures dumped when it is of the engine's generation and
    no later capture dumped nothing. An older one is refused unless named, when pre-restore
    hooks (which restore images) are installed; without them no image is used (None)."""
    hooks = bool(find_hooks(config.hooks_dir, HookPoint.PRE_RESTORE))
    images: dict[str, str | None] = {}
    for engine, status in statuses.items():
        if cmd.image is not None:
            dumped = journal.captures(engine, dumped=True)
            if cmd.image not in [op for op, _ in dumped]:
                raise UsageError(f"no image of {engine} from operation {cmd.image}; its "
                                 f"images: {', '.join(op for op, _ in dumped) or 'none'}",
                                 engine=engine, image=cmd.image)
            images[engine] = cmd.image
            continue
        # the newest capture and the newest that dumped: two rows, however many captures
        dumped = journal.captures(engine, limit=1, dumped=True)
        if not dumped:
            images[engine] = None
            continue
        op, data = dumped[0]
        newest = journal.captures(engine, limit=1)[0][0]
        later = newest != op  # a later capture that dumped nothing
        taken = data.get("generation")
        generation = status.generation if status is not None else taken
        if not later and generation == taken:
            images[engine] = op
        elif hooks:
            why = (f"capture {newest} dumped nothing since" if later else
                   f"{engine} is at generation {generation} now")
            raise UsageError(f"the newest image of {engine} is from operation {op}, taken at "
                             f"generation {taken}, and {why}: restore --image {op} to restore "
                             "it anyway", engine=engine, image=op, image_generation=taken,
                             generation=generation)
        else:
            images[engine] = None
    return images


def check_images(config: ControllerConfig, cmd: p.OperationCommand,
                 images: dict[str, str | None]) -> None:
    """Refuse a restore whose image's manifest records what this host differs in
    (``manifest.check``: ``CompatibilityError``, exit 2), before any hook or CRIU runs;
    ``cmd.accept`` names the fields accepted."""
    from ckpt_controller.controller import manifest
    from ckpt_controller.controller.images import folder_name

    for engine, image in images.items():
        if image is not None:
            manifest.check(config.image_dir / engine / folder_name(image), engine, image,
                           cmd.accept)

