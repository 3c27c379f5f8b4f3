"""The vLLM sidecar's wait drain (``VllmEngine.drain``) against the stand-in server
(``tests/vllm/standin_server.py``: a real process and real HTTP, not vLLM), with one request
that outlasts the drain's deadline: the drain fails, escalates to ``abort`` or ``keep``, or
stops at the operation's own deadline, as ``agent.drain.DrainPolicy`` decides for the agent's
own drain too, with the same errors. Against a real vLLM: ``test_vllm_adapter.py`` (``-m vllm``).
Neighbours: ``adapters.vllm.sidecar``, ``agent.drain``, ``test_drain_policy``.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest

from ckpt_controller import protocol as p
from ckpt_controller.adapters.vllm import VllmEngine, VllmHttp
from ckpt_controller.clock import Clock, Deadline
from ckpt_controller.errors import CkptError, DeadlineError, DrainError
from ckpt_controller.procutil import ReadyProcess
from ckpt_controller.vocab import DrainMode, Escalation, PrepareStep
from support.timing import wait_until
from support.vllm import STANDIN_SERVER


@pytest.fixture
def engine(tmp_path):
    server = ReadyProcess([sys.executable, str(STANDIN_SERVER)],
                          tmp_path / "standin.log", "the stand-in vLLM", timeout_s=60)
    eng = VllmEngine(VllmHttp(server.info["url"]), verify_weights=False, tick_s=0.05)
    try:
        yield eng
    finally:
        eng.close()
        server.stop()


def one_long_request(http: VllmHttp) -> None:
    """A request that runs a minute (the server is stopped long before), seen in flight."""
    def run() -> None:
        with contextlib.suppress(CkptError):  # the server stops under it at the test's end
            http.complete("long", 4, timeout_s=120, standin_gen_s=60)

    threading.Thread(target=run, name="long-request", daemon=True).start()
    wait_until(lambda: http.metrics().in_flight == 1, what="the long request in flight")


def command(on_deadline: Escalation, drain_timeout_s: float = 0.3) -> p.PrepareCommand:
    return p.PrepareCommand(call_id=0, op_id="op-v", drain=DrainMode.WAIT,
                            drain_timeout_s=drain_timeout_s, on_deadline=on_deadline)


def drain(eng: VllmEngine, cmd: p.PrepareCommand, deadline_s: float | None = None):
    return eng.drain(cmd, Deadline.after(deadline_s, Clock()), lambda event: None)


def test_fail_at_the_drain_deadline_names_what_is_in_flight(engine):
    one_long_request(engine.http)
    with pytest.raises(DrainError) as info:
        drain(engine, command(Escalation.FAIL))
    assert info.value.details == {"url": engine.http.url, "op_id": "op-v",
                                  "step": PrepareStep.DRAIN, "in_flight": 1,
                                  "drain_timeout_s": 0.3}


@pytest.mark.parametrize("on_deadline", [Escalation.ABORT, Escalation.KEEP])
def test_the_drain_deadline_escalates(engine, on_deadline):
    one_long_request(engine.http)
    report = drain(engine, command(on_deadline))
    assert report.mode == DrainMode.WAIT and report.escalated_to == on_deadline
    assert report.in_flight_at_start == 1
    # the stand-in aborts nothing: the request is still there, kept only when keeping
    assert report.kept == (1 if on_deadline is Escalation.KEEP else 0)


def test_the_operations_deadline_is_a_failure_not_an_escalation(engine):
    one_long_request(engine.http)
    with pytest.raises(DeadlineError) as info:
        drain(engine, command(Escalation.ABORT, drain_timeout_s=60), deadline_s=0.5)
    assert info.value.exit_code == 3
    assert info.value.details == {"url": engine.http.url, "op_id": "op-v",
                                  "step": PrepareStep.DRAIN}
