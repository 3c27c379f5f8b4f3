"""The open files a controller's roster needs, and the process limit raised to hold them.

Each engine costs the controller up to ``FILES_PER_ENGINE`` descriptors (its link: a socket,
its monitor pair, zmq's mailboxes; the monitor's link; a probe's), and the rest of the
controller ``FILES_BASE``. The usual soft limit is 1,024, so ``ensure`` raises it to the hard
limit (``zmqutil.room_for_connections``: clients' connections cost descriptors too); a roster
the hard limit cannot hold is refused with a ``ConfigError`` saying how many engines fit and what to raise, at start (``ckptctl serve`` exits 2) and for an
engine adopted later (refused before it is journaled). A controller that ran out of
descriptors in the middle of an operation once died of it: libzmq aborts the process when it
cannot make a socket's mailbox. Neighbours: ``server`` (at start and as the roster grows),
``service`` (an adoption), ``rpc`` (the zmq context's own socket limit).
"""

from __future__ import annotations

import logging
import resource

from ckpt_controller.errors import ConfigError
from ckpt_controller.rpc import SHARED_MAX_SOCKETS
from ckpt_controller.zmqutil import room_for_connections

log = logging.getLogger("ckpt_controller.controller")

#: descriptors the controller may hold per engine, and besides the engines
FILES_PER_ENGINE = 12
FILES_BASE = 256
#: zmq sockets per engine in the process's shared context (a link and its monitor pair, the
#: monitor's link), so a roster also stays within that context's ``SHARED_MAX_SOCKETS``
SOCKETS_PER_ENGINE = 4


def needed(engines: int) -> int:
    """The descriptors a controller of ``engines`` engines may need."""
    return FILES_PER_ENGINE * engines + FILES_BASE


def most_engines(limit: int) -> int:
    """The most engines ``limit`` open files (and the zmq context) hold."""
    return max(0, min((limit - FILES_BASE) // FILES_PER_ENGINE,
                      (SHARED_MAX_SOCKETS - 64) // SOCKETS_PER_ENGINE))


def ensure(engines: int) -> int:
    """Make room for a roster of ``engines``: raise the soft open-files limit to what it needs
    (the limit now is returned). ``ConfigError`` naming the numbers when the hard limit, or
    the zmq context's socket limit, cannot hold it; nothing changes then."""
    need = needed(engines)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = need if hard == resource.RLIM_INFINITY else hard
    if engines > most_engines(limit):
        fit = most_engines(limit)
        raise ConfigError(
            f"{engines} engines need about {need} open files and {engines * SOCKETS_PER_ENGINE} "
            f"zmq sockets; this controller may open {limit} files (its hard limit) and "
            f"{SHARED_MAX_SOCKETS} sockets, room for {fit} engines: raise LimitNOFILE= in its "
            "systemd unit (or ulimit -Hn before it starts), or split the engines over more "
            "controllers", key="engine", engines=engines, needed=need, limit=limit, fits=fit)
    if hard != resource.RLIM_INFINITY:  # all it allows (need <= hard, checked above)
        return room_for_connections()
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        log.debug("open files: soft limit %d -> %d for %d engines", soft, need, engines)
        return need
    return soft
