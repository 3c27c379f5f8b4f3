"""Child processes that announce readiness with one JSON line on stdout.

``ckptctl engine serve`` and ``ckptctl serve`` print ``{"event": "ready", ...}`` once their
sockets are bound; ``ReadyProcess`` starts such a command, waits for that line (with a
deadline), and stops it the way product.md asks for any child: SIGTERM, a grace period,
then SIGKILL. Used by the demo (and the tests, and drills). stderr goes to a log file.

Each child leads its own session (``setsid``): CRIU can only dump a process whose session
leader lives in the same PID namespace, and a child that inherited a session from outside a
container's namespace could not be captured. It also keeps a terminal's Ctrl-C from reaching
the child directly; the parent stops it in order instead.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from ckpt_controller.errors import OperationError


class ReadyProcess:
    def __init__(self, args: list[str], log: Path, what: str, *, timeout_s: float = 120.0,
                 cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.args, self.log_path, self.what, self.cwd, self.env = args, log, what, cwd, env
        self.info: dict = {}
        self.start(timeout_s)

    def start(self, timeout_s: float = 120.0) -> None:
        self.log = self.log_path.open("a")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.log,
                                     stdin=subprocess.DEVNULL, text=True, cwd=self.cwd, env=self.env,
                                     start_new_session=True)
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        line = box[0] if box else ""
        try:
            self.info = json.loads(line)
        except ValueError:  # policy: no ready line means it did not start; say where to look
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise OperationError(f"{self.what} did not start (see {self.log_path})",
                                 what=self.what, first_line=line[:200], log_tail=tail) from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_pipes()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self.log.closed:
            self.log.close()
