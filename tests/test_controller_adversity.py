"""The controller tried as an adversary and an operator would: starts that race, restarts,
odd names. Real ``ckptctl serve`` processes where a process is what is tried.

- A controller holds its ``ipc://`` endpoint from the moment it claims its state directory,
  not only once it binds: while it still recovers interrupted operations (the socket is not
  bound yet), a second controller of another state directory on the same endpoint is refused
  instead of binding the socket the first then takes from it.

Neighbours: ``test_serve_start`` (one controller per state directory, stale sockets),
``conftest`` (``ipc_dir``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckpt_controller.controller.client import ControllerClient
from ckpt_controller.controller.config import load_config
from ckpt_controller.controller.server import ControllerServer

ROOT = Path(__file__).resolve().parent.parent


def _config(folder: Path, name: str, endpoint: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f'[controller]\nendpoint = "{endpoint}"\n'
                    f'state_dir = "{folder / f"{name}-state"}"\n')
    return path


def test_an_endpoint_is_held_from_the_claim_not_only_from_the_bind(ipc_dir):
    """The first controller has claimed its state directory and endpoint but not bound yet
    (``serve`` recovers interrupted operations in between, which can take as long as an
    operation): a second one of another state directory on the same endpoint exits 2
    naming ``controller.endpoint`` and the first's PID, and the first then binds and serves,
    alone."""
    endpoint = f"ipc://{ipc_dir}/ctl.sock"
    first = ControllerServer(load_config(_config(ipc_dir, "first", endpoint)))
    try:
        second = subprocess.Popen([sys.executable, "-m", "ckpt_controller", "serve",
                                   "--config", str(_config(ipc_dir, "second", endpoint))],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT)
        try:
            out, err = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            second.terminate()
            out, err = second.communicate()
            raise AssertionError(f"the second controller runs on the first's endpoint: {out}")
        assert second.returncode == 2, out + err
        assert out == ""  # never announced itself ready
        assert "controller.endpoint" in err, err
        assert f"pid {os.getpid()}" in err and "Traceback" not in err, err
        first.start()
        with ControllerClient(endpoint, timeout_s=5, retries=0) as c:
            assert c.handshake().pid == os.getpid()
    finally:
        first.close()
    assert not [f.name for f in ipc_dir.iterdir() if f.name.startswith("ctl.sock")]
    # let go on close: a later controller of either state directory may take the endpoint
    again = ControllerServer(load_config(ipc_dir / "second.toml")).start()
    again.close()

