"""The controller's connections to its agents, kept open and subscribed between operations.

Opening a session with an agent costs three round trips (handshake, subscribe, status) and a
new connection; an operation of one engine is itself only two or three. ``AgentLinks`` keeps
one ``AgentLink`` per engine (subscribed once a session opened it): an operation (which holds its engines, so one user
at a time) takes the engine's link, and gives it back when it ends. A link is used again only
while it is surely still what it was when it subscribed; otherwise it is closed and a fresh
one made, exactly as without the pool:

- its first contact settled (the agent answered), and its last user ended without a
  transport failure (no reopened socket, no lost contact, no
  bad frame: ``healthy``);
- its connection never dropped since it subscribed (a socket monitor sees every disconnect:
  a restarted agent, one restored from an image, or a dead one, always drops it);
- it was idle less than ``IDLE_REFRESH_S`` (an idle link's heartbeats queue up unread; the
  agent forgets a subscriber whose queue is full).

What queued while it was idle (heartbeats, an operator's own transitions) is read when it is
taken, and belongs to no operation; it does tell what the link knows of its engine
(``known``). A link that asked its agent's status once follows it from then on, through the
replies of its operations and its subscription's events and heartbeats: the state, the
generation, and when it last heard from a live agent. While that is recent (``knows``), an
operation starts from it instead of asking again: one request and round trip fewer per engine
and operation. The PID stays what the status said: a restarted or restored process drops the
connection, and a link whose connection dropped is never used again. Neighbours: ``session``
(the user of a link), ``service`` (owns the pool), ``preflight`` (asks a held engine's status
over its link),
``agent.client`` (the requests), ``rpc`` (the transport).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from ckpt_controller import protocol as p
from ckpt_controller.agent.client import AgentClient
from ckpt_controller.controller.config import ControllerConfig
from ckpt_controller.errors import (
    CkptError,
    InvalidTransitionError,
    ProtocolError,
    UnreachableError,
)
from ckpt_controller.vocab import CheckpointState
from ckpt_controller.zmqutil import monitor_socket

log = logging.getLogger("ckpt_controller.controller")

#: a link idle longer than this is replaced rather than used again
IDLE_REFRESH_S = 60.0
#: a request's timeout on a link (operations are bounded by heartbeats instead); one resend
LINK_TIMEOUT_S = 2.0
#: how recently a link must have heard from its agent for an operation to start from what
#: it knows (``AgentLink.knows``) instead of asking the agent's status: no older than a
#: status the operation would read just before
KNOWN_FRESH_S = 1.0
#: the requests that move an engine (a resend of one answered by a refusal is contact lost)
_STEPS = frozenset({p.RequestType.PREPARE, p.RequestType.RESTORE, p.RequestType.ROLLBACK})
#: a heartbeat's state (a string on the wire) as an engine's state
_STATES = {s.value: s for s in CheckpointState}


class AgentLink(AgentClient):
    """An ``AgentClient`` whose event and reply listeners change with its user, and which
    knows whether it may be used again (``reusable``). Its commands are built by the
    controller from checked values, so they are not checked again before sending (the agent's
    decoder checks them as it reads them)."""

    checks_commands = False

    def __init__(self, *args, **kw) -> None:
        self.on_reply: Callable[[object], None] | None = None
        #: False once a request failed in transport (the pool then closes it)
        self.healthy = True
        self._monitor: zmq.Socket | None = None
        self._idle_since = time.monotonic()
        #: the agent's status as this link last learned it: asked once, then kept current
        #: (state, generation) by replies, events and heartbeats; None until first asked
        self.known: p.StatusReply | None = None
        #: our monotonic clock when the agent was last heard alive (``knows``)
        self._heard_at = float("-inf")
        #: our monotonic clock less the agent's, at most: the least of (reply read at) less
        #: (its last transition) over the replies so far, each an upper bound (a transition
        #: made long before its reply, as a stepwise drain's, only overstates it); places a
        #: heartbeat read later at the time the agent sent it, never later than it was
        #: (None: not yet known)
        self._offset: float | None = None
        #: the agent's clock at the newest transition this link knows of: a reply whose
        #: transitions are older is one the agent kept for a repeated op id, and says
        #: nothing of now
        self._newest = float("-inf")
        super().__init__(*args, **kw)

    def call(self, rtype, cmd, **kw):
        try:
            result = super().call(rtype, cmd, **kw)
        except (UnreachableError, ProtocolError):
            self.healthy = False
            raise
        except InvalidTransitionError as exc:
            if rtype not in _STEPS or self.attempt == 1:
                raise
            # a step sent again after no answer, refused: the agent that ran it would have
            # answered with its first result (its op id), so another agent process answered
            # (a sidecar restarted within seconds, finding its engine paused: FAILED). The
            # step's engine is where that agent left it: contact was lost, and the
            # reconciler settles it, as after a restart that took longer
            self.healthy = False
            raise UnreachableError(
                f"contact lost with {self.endpoint}: the step was sent again after no "
                f"answer, and the agent that answered does not know it ({exc.message}); it "
                "restarted meanwhile", endpoint=self.endpoint, reason="restarted",
                refused=exc.message) from exc
        self._learn(result)
        if self.on_reply is not None:
            self.on_reply(result)
        return result

    # ---------------------------------------------------------------- what it knows

    def knows(self, fresh_s: float) -> p.StatusReply | None:
        """The agent's status as this link follows it, when the agent was heard alive in the
        last ``fresh_s`` (a reply, or a heartbeat sent since); else None: ask it."""
        if self.known is None or time.monotonic() - self._heard_at >= fresh_s:
            return None
        return self.known

    def _learn(self, result: object) -> None:
        """A reply: the agent is alive now, and says its state."""
        now = time.monotonic()
        if isinstance(result, p.StatusReply):
            self.known, self._heard_at = result, now
            last = result.last_transition
            self._newest = last.monotonic if last is not None else float("-inf")
            return
        if self.known is None:
            return
        if isinstance(result, (p.PrepareReply, p.RestoreReply)):
            self._heard_at = now
            if not result.transitions:
                return  # it moved nothing: the state known stays (a kept reply's is old)
            last = result.transitions[-1]
            if last.monotonic < self._newest:
                return  # the kept reply of a repeated op id: its state and time are then's
            self._newest = last.monotonic
            self.known.state = result.state
            if isinstance(result, p.RestoreReply):
                self.known.generation = result.generation
            bound = now - last.monotonic
            self._offset = bound if self._offset is None else min(self._offset, bound)
        elif isinstance(result, p.HeartbeatReply) and result.state in _STATES:
            self._heard_at = now
            self.known.state = _STATES[result.state]

    def _on_event(self, body: p.EventBody) -> None:
        known = self.known
        if known is not None:
            if isinstance(body, p.Heartbeat):
                state = _STATES.get(body.state)
                if state is None or body.incarnation != known.incarnation:
                    # restored from an image (another clock, maybe), or not an engine: ask
                    self.known, self._offset = None, None
                else:
                    known.state = state
                    if self._offset is not None:  # when it was sent, not when we read it
                        sent = body.monotonic + self._offset
                        if sent <= time.monotonic():  # never later than now (NaN, inf: no)
                            self._heard_at = max(self._heard_at, sent)
            elif isinstance(body, p.StateChanged):
                known.state, known.generation = body.transition.dest, body.transition.generation
                self._newest = max(self._newest, body.transition.monotonic)
        super()._on_event(body)

    def _reopen(self) -> None:
        self.healthy = False  # a new socket: the subscription is no longer sure
        self._stop_watching()
        super()._reopen()

    def close(self) -> None:
        self._stop_watching()
        super().close()

    # ---------------------------------------------------------------- in the pool

    def park(self) -> None:
        """Going idle: listeners off; from now on watch the connection for a drop."""
        self.on_event = self.on_reply = None
        self._idle_since = time.monotonic()
        if self._monitor is None and self._contact is not None and self._contact.settled:
            self._monitor = monitor_socket(self._sock, zmq.EVENT_DISCONNECTED)

    def reusable(self) -> bool:
        """Whether this parked link may serve another operation; reads what queued while it
        was idle (what it knows is brought up to date; the events themselves are dropped). A
        link whose first contact never settled has no watch on its connection and is not
        used again."""
        if not (self.healthy and self._monitor is not None):
            return False
        if time.monotonic() - self._idle_since > IDLE_REFRESH_S:
            return False
        if self.dropped():
            return False  # the connection dropped at least once while it was parked
        try:
            self._take_pending()
        except CkptError:  # policy: a frame we cannot read: not worth reusing
            return False
        self.events.clear()
        return True

    def dropped(self) -> bool:
        """Whether the socket monitor saw this link's connection drop (reads nothing)."""
        return self._monitor is not None and bool(self._monitor.poll(0, zmq.POLLIN))

    def _stop_watching(self) -> None:
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:  # policy: the socket is closed already: nothing to stop
                pass
            self._monitor.close(linger=0)
            self._monitor = None


class AgentLinks:
    """One parked link per engine, at most; thread-safe."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._parked: dict[str, AgentLink] = {}
        self._closed = False
        #: links made, and links used again (what ``bench/control.py`` and the tests read)
        self.opened = 0
        self.reused = 0

    def take(self, engine: str, on_event: Callable[[p.EventBody], None] | None = None,
             on_reply: Callable[[object], None] | None = None) -> AgentLink:
        """``engine``'s parked link if it is still good, else a new (unsubscribed) one."""
        with self._lock:
            link = self._parked.pop(engine, None)
        if link is not None and link.reusable():
            self.reused += 1
        else:
            if link is not None:
                link.close()
            link = self._new(engine)
        link.on_event, link.on_reply = on_event, on_reply
        return link

    def fresh(self, engine: str, on_event: Callable[[p.EventBody], None] | None = None,
              on_reply: Callable[[object], None] | None = None) -> AgentLink:
        """A new link, whatever is parked (after a hook restored the engine's process)."""
        link = self._new(engine)
        link.on_event, link.on_reply = on_event, on_reply
        return link

    def give(self, engine: str, link: AgentLink) -> None:
        """Park ``link`` for ``engine``'s next operation, or close it when it cannot serve
        one (unhealthy) or another is parked already."""
        if not link.healthy:
            link.close()
            return
        try:
            link.park()
        except zmq.ZMQError as exc:  # policy: a link we cannot watch is not kept
            log.warning("%s: connection not kept: %s", engine, exc)
            link.close()
            return
        with self._lock:
            if self._closed or engine in self._parked:
                old = link
            else:
                self._parked[engine], old = link, None
        if old is not None:
            old.close()

    def parked_knows(self, engine: str) -> p.StatusReply | None:
        """What ``engine``'s parked link knows of it, however old (None: none parked, or it
        knows nothing); for tests and diagnostics."""
        with self._lock:
            link = self._parked.get(engine)
        return link.known if link is not None else None

    def parked_dropped(self, engine: str) -> bool:
        """Whether ``engine``'s parked link saw its connection drop (it will not be used
        again); for tests and diagnostics: a killed agent's drop reaches the socket monitor a
        moment after the kill, and an operation taken before that starts from what the link
        knew (and finds the agent gone within its heartbeat silence)."""
        with self._lock:
            link = self._parked.get(engine)
        return link is not None and link.dropped()

    def drop(self, engine: str) -> None:
        """Close ``engine``'s parked link, if any: it was given away, or adopted (a link of
        an earlier stay here leads to its old endpoint)."""
        with self._lock:
            link = self._parked.pop(engine, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            parked, self._parked = list(self._parked.values()), {}
        for link in parked:
            link.close()

    def _new(self, engine: str) -> AgentLink:
        self.opened += 1
        eng = self.config.engine(engine)
        return AgentLink(eng.control, timeout_s=LINK_TIMEOUT_S, retries=1,
                         heartbeat_interval_s=self.config.heartbeat_interval_s,
                         missed_beats=self.config.missed_beats, name=f"controller/{engine}",
                         curve=self.config.agent_curve(engine))
