"""The test zygote (``support.zygote``): a forked engine is started as an exec'd one would be
(its own session, the test's folder, environment, arguments and stdio), and its end reads as
``subprocess.Popen`` would say it; a zygote that goes takes its children with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest

from support import zygote
from support.processes import ReferenceProcess, gone
from support.timing import scaled, wait_until

SCRIPT = """
import json, os, sys
print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(),
                  "argv": sys.argv, "said": os.environ.get("ZYGOTE_SAID"),
                  "main": __name__, "stdin": sys.stdin.read()}), flush=True)
code = sys.argv[1]
if code == "wait":
    import time
    time.sleep(600)
sys.exit(int(code))
"""


@pytest.fixture
def forker(tmp_path, monkeypatch):
    """A zygote of this test's own (one torch thread, as under xdist), closed after."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    made = zygote.Zygote.start()
    if not made.ready:
        made.close()
        pytest.skip("the zygote found more than one thread after its imports")
    yield made
    made.close()


def _fork(forker, tmp_path, *argv: str):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    log = (tmp_path / "child.log").open("a")
    env = {**os.environ, "ZYGOTE_SAID": "from the test"}
    child = forker.fork({"script": str(script), "argv": [str(script), *argv],
                         "cwd": str(tmp_path), "env": env}, log)
    log.close()
    assert child is not None
    said = json.loads(child.stdout.readline())
    child.stdout.close()
    return child, said


def test_a_forked_child_starts_as_an_execd_one(forker, tmp_path):
    child, said = _fork(forker, tmp_path, "3")
    assert said["pid"] == child.pid and said["sid"] == child.pid  # a session of its own
    assert said["cwd"] == str(tmp_path) and said["argv"][1:] == ["3"]
    assert said["said"] == "from the test" and said["main"] == "__main__"
    assert said["stdin"] == ""  # /dev/null
    assert child.wait(scaled(10)) == 3 and child.poll() == 3


def test_its_end_reads_as_popen_says(forker, tmp_path):
    child, _ = _fork(forker, tmp_path, "wait")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.1)
    child.terminate()
    assert child.wait(scaled(10)) == -signal.SIGTERM
    child.kill()  # already ended: nothing to signal, no error


def test_a_zygote_that_ends_takes_its_children(forker, tmp_path):
    child, _ = _fork(forker, tmp_path, "wait")
    forker.close()
    assert child.wait(scaled(10)) == -signal.SIGKILL
    wait_until(lambda: gone(child.pid), scaled(10), "the child gone with its zygote")


def test_a_reference_engine_forked_serves_and_stops(monkeypatch, tmp_path, ipc_dir, model_dir):
    """``ckptctl engine serve`` through the worker's zygote (``python -m`` in-process): it
    answers as an exec'd one does, is no child of this process, and stops on SIGTERM."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", os.environ.get("PYTEST_XDIST_WORKER", "gw0"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CKPT_TEST_FORK", "1")  # also in a run that turned it off
    monkeypatch.setattr(zygote, "_zygote", None)  # a zygote that reads this environment
    try:
        eng = ReferenceProcess(ipc_dir, model_dir, "forked")
        try:
            assert isinstance(eng.proc, zygote.ForkedProcess)
            assert eng.info["pid"] == eng.pid
            assert psutil.Process(eng.pid).ppid() != os.getpid()
            from ckpt_controller.agent import AgentClient

            with AgentClient(eng.control) as agent:
                assert agent.status().state == "running"
        finally:
            eng.stop()
        assert eng.proc.returncode == 0
    finally:
        if zygote._zygote is not None:
            zygote._zygote.close()
