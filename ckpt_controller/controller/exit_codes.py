"""The exit status ``ckptctl`` gives an operation's result.

Kept apart from the service so the CLI can import it without the controller (sessions,
hooks, journal). Neighbours: ``errors`` (each error's own ``exit_code``), ``protocol``
(``OperationResult``), ``cli.controller_cmds`` (its caller).
"""

from __future__ import annotations

from ckpt_controller import protocol as p
from ckpt_controller.vocab import OperationStatus


def exit_code(result: p.OperationResult) -> int:
    """0 success; 3 if a deadline passed; 4 if an engine was unreachable; 2 if every error
    was a usage error (nothing was tried); else 1."""
    if result.status == OperationStatus.SUCCEEDED:
        return 0
    infos = [o.error for o in result.engines if o.error] + ([result.error] if result.error else [])
    codes = {info.to_exception().exit_code for info in infos}
    for code in (3, 4):
        if code in codes:
            return code
    return 2 if codes == {2} else 1
