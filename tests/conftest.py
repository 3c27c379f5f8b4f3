"""The fixtures every folder of tests uses, and the pytest hooks of the whole suite.

Fixtures here start real child processes (engines, reference engines, controllers, etcd)
in private folders and stop them after the test; the processes themselves and everything
else more than one test module shares live in the ``support`` package. A fixture only one
folder's tests use lives in that folder's ``conftest.py``. Neighbours: ``support``,
``tests/*/conftest.py``, pyproject.toml (marks, the default run's ``-m``).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys

import pytest
import zmq

from support import zygote
from support.processes import (ControllerProcess, EngineProcess, ReferenceProcess, SharedEngine,
                               Started, kill_naming, private_dir, stop_all)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite on a few workers per core (most tests wait on processes);
    # torch's OpenMP threads spin while they wait, so several workers' engines each with a
    # thread per core slow each other down many times over. One compute thread each, set
    # before anything imports torch, for this worker and every process it starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # started in the background by a shell without job control (`make test &`): SIGINT is
    # ignored, and every ckptctl a test starts would inherit that, so the tests that press
    # Ctrl-C on one would wait in vain. Those tests try the default, Python's own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: CI sets this: every real part (CRIU, nftables, vLLM, network namespaces) can be installed
#: there, so a test that would skip for want of one fails instead. Only a GPU may be missing.
REQUIRE_PARTS = os.environ.get("CKPT_REQUIRE_PARTS") == "1"
_MAY_SKIP = ("cuda", "gpu")
#: set on a test whose call failed: its teardown collects the garbage it left
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.failed:
        item.stash[_FAILED] = True
    if REQUIRE_PARTS and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple)
                     else report.longrepr)
        if not any(word in reason.lower() for word in _MAY_SKIP):
            report.outcome = "failed"
            report.longrepr = f"CKPT_REQUIRE_PARTS=1, but this test would skip: {reason}"


def pytest_runtest_teardown(item):
    """A failed test's assertion skips its own clean-up (a client's ``close``); the sockets it
    left would warn in whichever later test the garbage collector ran, failing that one too.
    Collected here, they warn in the failed test's own teardown. pytest keeps the failure in
    ``sys.last_*`` (for a debugger) until the next test, and its frames hold those sockets."""
    if item.stash.get(_FAILED, False):
        for name in ("last_exc", "last_type", "last_value", "last_traceback"):
            if hasattr(sys, name):
                delattr(sys, name)
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _zygote_session():
    """This worker's zygote, if a test made one, ends with the session."""
    yield
    zygote.shutdown()


@pytest.fixture(autouse=True)
def _engine_start(request):
    """Engines of a test marked ``exec_engines`` are exec'd, never forked (``zygote``)."""
    zygote.allowed = request.node.get_closest_marker("exec_engines") is None
    yield
    zygote.allowed = True


@pytest.fixture
def ipc_dir():
    d = private_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models")
    yield path
    # engines restored from a CRIU image are no children of ours: every engine of this session
    # names this folder on its command line, so nothing it started outlives the session
    kill_naming(str(path))


@pytest.fixture(scope="module")
def shared_engines(model_dir):
    """``shared(kind, name, *args, **opts)``: a ``SharedEngine`` for this module, made once
    per name; ``kind`` is ``"step"`` (``EngineProcess``, in a folder of its own, so its
    weights file is its own) or ``"reference"`` (``ReferenceProcess``)."""
    root = private_dir()
    made: dict[str, SharedEngine] = {}

    def shared(kind: str, name: str, *args: str, **opts) -> SharedEngine:
        if name not in made:
            if kind == "step":
                def make(name=name):
                    folder = root / name
                    folder.mkdir(mode=0o700, exist_ok=True)
                    return EngineProcess(folder, name, **opts)
            else:
                def make(name=name):
                    return ReferenceProcess(root, model_dir, name, *args)
            made[name] = SharedEngine(make)
        return made[name]

    yield shared
    stop_all([one.engine for one in made.values() if one.engine is not None])
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def spawn_engine(ipc_dir):
    """``spawn(name="eng", **opts)``: an ``EngineProcess`` (step engine), stopped after."""
    spawn = Started(lambda name="eng", **opts: EngineProcess(ipc_dir, name, **opts))
    yield spawn
    spawn.stop()


@pytest.fixture
def spawn_reference(ipc_dir, model_dir):
    """``spawn(name="ref", *extra, api=, control=)``: a ``ReferenceProcess``, stopped after."""
    spawn = Started(lambda name="ref", *extra, **endpoints: ReferenceProcess(
        ipc_dir, model_dir, name, *extra, **endpoints))
    yield spawn
    spawn.stop()


@pytest.fixture
def spawn_controller(ipc_dir):
    """``spawn(config_text, **kw)``: a ``ControllerProcess`` in ``ipc_dir``, stopped after."""
    spawn = Started(lambda config_text, **kw: ControllerProcess(ipc_dir, config_text, **kw))
    yield spawn
    spawn.stop()


@pytest.fixture
def etcd(tmp_path):
    """One real etcd member (``make etcd``); skips with the reason when it is not installed."""
    from support import etcd_cluster

    if not etcd_cluster.installed():
        pytest.skip("etcd is not installed: run `make etcd`")
    cluster = etcd_cluster.EtcdCluster(tmp_path / "etcd", size=1)
    yield cluster
    cluster.close()


@pytest.fixture
def silent_server(ipc_dir):
    """A ROUTER that takes whatever arrives and never answers: ``(endpoint, received)``,
    ``received()`` counting what came (a client's checks must send nothing)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{ipc_dir}/silent.sock"
    sock.bind(endpoint)

    def received() -> int:
        n = 0
        while sock.poll(300, zmq.POLLIN):
            sock.recv_multipart()
            n += 1
        return n

    yield endpoint, received
    sock.close(linger=0)

