"""CRIU for the tests: where it is (``make criu``, or ``$CKPT_CRIU``) and why a CRIU or a
migration test cannot run here, said once for every module that needs it.

CI sets ``CKPT_REQUIRE_CRIU=1`` where CRIU can be installed: then a reason not to run is an
error at import (``required``), not a skip. Neighbours: ``etcd_cluster`` (a migration needs
etcd too), ``netns_util``, the shipped hooks ``hooks/criu-dump`` and ``hooks/criu-restore``.
"""

from __future__ import annotations

import functools
import os
import subprocess

from support import ROOT, etcd_cluster

CRIU = os.environ.get("CKPT_CRIU") or str(ROOT / ".cache" / "criu" / "bin" / "criu")


@functools.cache
def criu_missing() -> str | None:
    """Why real CRIU cannot run here (not installed, not root, ``criu check`` failing), or
    ``None``; ``criu check`` runs once per process."""
    if not os.path.exists(CRIU):
        return f"no CRIU at {CRIU}: run `make criu` (CRIU 4.2+ from Debian unstable)"
    if os.geteuid() != 0:
        return "CRIU needs root here"
    check = subprocess.run([CRIU, "check"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return f"criu check fails: {check.stdout[-300:]} {check.stderr[-300:]}"
    return None


def migration_missing() -> str | None:
    """Why a migration between two nodes cannot run here (root, CRIU, etcd), or ``None``."""
    if os.geteuid() != 0:
        return "migration needs root (CRIU, network namespaces)"
    if not os.path.exists(CRIU):
        return f"no CRIU at {CRIU}: run `make criu`"
    if not etcd_cluster.installed():
        return "etcd is not installed: run `make etcd`"
    return None


def required(reason: str | None, what: str) -> str | None:
    """``reason`` (why ``what`` cannot run, or ``None``), for a skip mark; under
    ``CKPT_REQUIRE_CRIU=1`` a reason raises ``RuntimeError`` instead."""
    if reason is not None and os.environ.get("CKPT_REQUIRE_CRIU") == "1":
        raise RuntimeError(f"CKPT_REQUIRE_CRIU=1, but {what} cannot run: {reason}")
    return reason


def tcp_engine(spawn_reference, name: str, *extra: str):
    """A reference engine (``spawn_reference``, with ``extra`` flags) on two free TCP ports:
    CRIU cannot dump a unix-socket connection to a peer outside the tree, while ZMQ peers
    reconnect to TCP ones. A port found free may be taken before the engine binds it
    (another test's outgoing connection draws from the same range): then it starts again on
    two others, up to three times."""
    from ckpt_controller.endpoints import free_port
    from ckpt_controller.errors import OperationError

    for attempt in range(3):
        try:
            return spawn_reference(name, *extra, api=f"tcp://127.0.0.1:{free_port()}",
                                   control=f"tcp://127.0.0.1:{free_port()}")
        except OperationError as err:
            if "Address already in use" not in str(err.details) or attempt == 2:
                raise

