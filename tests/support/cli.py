"""``ckptctl`` as a test runs it: a real child process of this interpreter, and its output.

Neighbours: ``processes`` (``ControllerProcess.ckptctl`` runs through ``ckptctl`` here),
``timing`` (its limits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from support import ROOT
from support.timing import scaled

#: the command line that starts ``ckptctl`` from this checkout, for ``Popen`` and
#: ``ReadyProcess``; ``ckptctl(...)`` runs it to the end
CKPTCTL = (sys.executable, "-m", "ckpt_controller")
#: how long a ``ckptctl`` run may take before the test gives up on it
RUN_TIMEOUT_S = 120.0


def ckptctl(*args: str, env: Mapping[str, str] | None = None, timeout: float | None = None,
            wrap: Sequence[str] = (), endpoint: str | None = None
            ) -> subprocess.CompletedProcess:
    """Run ``ckptctl ARGS`` to its end and return it (text stdout and stderr captured).

    ``endpoint``: ``--controller ENDPOINT`` before the arguments; ``env``: variables added to
    this process's environment; ``wrap``: a command that execs the rest (``ip netns exec
    NAME``); ``timeout``: seconds (``RUN_TIMEOUT_S`` by default), ``timing.scaled``."""
    argv = [*wrap, *CKPTCTL]
    if endpoint is not None:
        argv += ["--controller", endpoint]
    return subprocess.run([*argv, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=scaled(RUN_TIMEOUT_S if timeout is None else timeout),
                          env=None if env is None else {**os.environ, **env})


class StreamedLines:
    """The lines of a child's ``stream`` (its stdout, ``text=True``), read on a thread of
    their own as the child prints them: a test waits for the lines it needs
    (``wait_until``) instead of for a child that stops after a fixed time."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def join(self, timeout_s: float = 20.0) -> list[str]:
        """Every line, once the child closed its end (it exited), within ``timeout_s``
        (``timing.scaled``)."""
        self._thread.join(scaled(timeout_s))
        assert not self._thread.is_alive(), "the child's output never ended"
        return self.lines
