"""The reference engine as a real process (``ckptctl engine serve``): batching, determinism
across restarts, every drain mode under load with nothing lost, ``keep`` outputs identical to
an uninterrupted run, and real memory released at level 2."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import psutil
import pytest

from ckpt_controller.agent import AgentClient
from ckpt_controller.engine.client import EngineClient
from ckpt_controller.engine.load import replay, run_load
from ckpt_controller.errors import RejectedError, UsageError
from support.cli import CKPTCTL, ckptctl
from support.timing import deadline_in, scaled, wait_until

MIB = 1 << 20


@pytest.fixture
def clients():
    made = []

    def make(kind, endpoint, **kw):
        c = kind(endpoint, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def tiny(shared_engines):
    """The tiny model (seed 0), one process for this module's tests that leave it RUNNING and
    idle: they cycle it, load it and abort on it, but none needs it fresh."""
    return shared_engines("reference", "tiny").get()


@pytest.fixture
def uncycled(shared_engines):
    """The same model in an engine that never goes through a cycle: the outputs to compare
    with."""
    return shared_engines("reference", "uncycled").get()


def test_concurrent_requests_decode_together(tiny, clients):
    """Six requests sent together are decoded together: one engine step gives each of them
    its next token (60 tokens each take about 60 steps, not 360), each got its first token
    before any finished, and their events are queued then scheduled, stamped in order."""
    eng = tiny
    client = clients(EngineClient, eng.api)
    ids = [client.submit([7, i, 3], 60) for i in range(6)]
    deadline = deadline_in(60)
    while not all(client.requests[i].ended for i in ids) and time.monotonic() < deadline:
        client.poll(0.05)
    done = [client.requests[i] for i in ids]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 60 for c in done)
    steps = sorted({s for c in done for s in c.steps})
    assert all(len(c.steps) == 60 for c in done)
    # one request per step would need 360 steps; a batch needs 60 (plus the steps taken while
    # the six arrive and are admitted: 11 were seen on a loaded machine)
    assert steps[-1] - steps[0] < 100, f"the six requests spanned {steps[-1] - steps[0]} steps"
    # while two were decoding, every step gave each of them a token (taking turns would share
    # no step at all); how far apart they arrived depends on this machine's load, so the
    # window is each pair's own, and the six shared at least half of their steps
    for a in done:
        for b in done:
            window = set(range(max(a.steps[0], b.steps[0]), min(a.steps[-1], b.steps[-1]) + 1))
            assert window <= set(a.steps) & set(b.steps), (a.steps, b.steps)
    together = min(c.steps[-1] for c in done) - max(c.steps[0] for c in done)
    assert together >= 20, f"the six decoded together for {together} steps only"
    assert max(c.first_token_at for c in done) <= min(c.ended_at for c in done)
    for c in done:
        assert [e.type for e in c.events][:2] == ["queued", "scheduled"]
        stamps = [e.timestamp for e in c.events]
        assert stamps == sorted(stamps) and stamps[0] > 0


def test_a_stop_token_ends_a_request_with_stop(tiny, clients):
    eng = tiny
    client = clients(EngineClient, eng.api)
    free = client.generate([5, 6, 7], 30).token_ids
    stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    got = client.generate([5, 6, 7], 30, stop_token_id=free[stop_at])
    assert got.finish_reason == "stop"
    assert got.token_ids == free[:stop_at + 1]  # ends with the stop token itself
    cli = ckptctl("generate", "--api", eng.api, "--prompt-ids", "5,6,7", "--max-tokens", "30",
                  "--stop-id", str(free[stop_at]), "--json", timeout=60)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["finish_reason"] == "stop" and out["token_ids"] == free[:stop_at + 1]


def test_same_seed_same_tokens_across_restarts(spawn_reference, uncycled, clients, model_dir):
    prompts = [[1, 2, 3], [500, 4], [9] * 20]
    first = uncycled  # an engine of this seed started earlier
    c1 = clients(EngineClient, first.api)
    want = [c1.generate(p, 40).token_ids for p in prompts]
    second = spawn_reference("det2")
    c2 = clients(EngineClient, second.api)
    assert [c2.generate(p, 40).token_ids for p in prompts] == want
    other = spawn_reference("det3", "--seed", "5")
    c3 = clients(EngineClient, other.api)
    assert c3.generate(prompts[0], 40).token_ids != want[0]


def test_invalid_requests_get_typed_errors(tiny, clients):
    eng = tiny
    c = clients(EngineClient, eng.api)
    with pytest.raises(UsageError, match="vocabulary"):
        c.generate([1, 99_999], 5)
    with pytest.raises(UsageError, match="empty"):
        c.generate([], 5)
    with pytest.raises(UsageError, match="prompt too long"):
        c.generate([1] * 5000, 5)
    assert c.generate([1], 3).finish_reason == "length"


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_cycle_under_load_loses_nothing(tiny, uncycled, clients, mode):
    eng = tiny
    ctl = clients(AgentClient, eng.control, timeout_s=30)
    result = {}
    load = threading.Thread(target=lambda: result.update(zip(("report", "requests"), run_load(
        eng.api, rate=40, duration_s=3.0, seed=11, settle_s=60))))
    load.start()
    # three long requests of the test's own (1,000 tokens: a second or more) beside the
    # load's short ones, decoding before the prepare: each drain mode always has requests in
    # flight to show its work on, however long a busy machine keeps the prepare from
    # arriving (the load's own, of 16 to 128 tokens, could all have ended by then)
    own = clients(EngineClient, eng.api)
    mine = [own.submit([7, i, 3], 1000) for i in range(3)]
    deadline = deadline_in(30)
    while not all(own.requests[r].first_token_at is not None for r in mine):
        assert time.monotonic() < deadline, "the test's own requests never decoded"
        own.poll(0.02)
    while ctl.status().in_flight < 6:  # and the load's requests too
        assert time.monotonic() < deadline, "the load never had 3 requests in flight"
        time.sleep(0.02)
    prep = ctl.prepare(drain=mode, level=2, drain_timeout_s=20)
    prepared_at = time.monotonic()
    assert prep.state == "prepared"
    time.sleep(0.3)
    restore_at = time.monotonic()
    ctl.restore()
    load.join(scaled(90))
    while not all(own.requests[r].ended for r in mine):
        assert time.monotonic() < deadline + 90, "the test's own requests never ended"
        own.poll(0.1)
    report, requests = result["report"], result["requests"]
    assert report.sent >= 100 and report.lost == 0, report
    assert report.completed + report.aborted + report.rejected == report.sent
    assert report.rejected > 0  # requests arrived while not RUNNING and were told so
    for c in requests.values():
        assert c.ended
    assert prep.drain.escalated_to is None  # each mode did its own work, no escalation
    assert prep.drain.in_flight_at_start >= len(mine)
    want = {"wait": "length", "abort": "abort", "keep": "length"}[mode]
    assert [own.requests[r].finish_reason for r in mine] == [want] * len(mine)
    if mode == "wait":
        assert prep.drain.completed == prep.drain.in_flight_at_start
        assert report.aborted == 0 and prep.drain.kept == 0
    if mode == "abort":
        assert prep.drain.aborted == report.aborted + len(mine)
        assert all(0 < len(own.requests[r].token_ids) < 1000 for r in mine)
    if mode == "keep":
        assert report.aborted == 0
        # admitted before the engine was prepared, ended only once the restore began: exactly
        # the kept ones (a request sent while the prepare call was on its way is kept too)
        across = [rid for rid, c in requests.items() if c.rejected is None
                  and c.sent_at < prepared_at and c.ended_at > restore_at]
        assert len(across) + len(mine) == prep.drain.kept
    # every completed request, kept ones included, has exactly its output from an engine
    # that never went through a cycle (same seed, same model)
    completed = {rid: c.token_ids for rid, c in requests.items()
                 if c.finish_reason in ("stop", "length")}
    assert completed == replay(uncycled.api, 11, list(completed))
    if want == "length":
        straight = clients(EngineClient, uncycled.api)
        ref = [straight.submit([7, i, 3], 1000) for i in range(3)]
        while not all(straight.requests[r].ended for r in ref):
            assert time.monotonic() < deadline + 180, "the uncycled engine never answered"
            straight.poll(0.1)
        assert [own.requests[r].token_ids for r in mine] == \
            [straight.requests[r].token_ids for r in ref]


def test_rejection_is_immediate_and_retryable(tiny, clients):
    eng = tiny
    ctl = clients(AgentClient, eng.control)
    c = clients(EngineClient, eng.api)
    ctl.prepare(level=1)
    start = time.monotonic()
    with pytest.raises(RejectedError) as info:
        c.generate([1, 2], 5)
    assert time.monotonic() - start < scaled(1.0)
    assert info.value.retryable and info.value.details["state"] == "prepared"
    assert info.value.details["retry_after_s"] > 0
    ctl.restore()
    assert c.generate([1, 2], 5).finish_reason == "length"


def test_level2_rss_falls_and_returns(spawn_reference, clients):
    eng = spawn_reference("rss", "--model", "small", "--kv-blocks", "256")
    ctl = clients(AgentClient, eng.control, timeout_s=60)
    c = clients(EngineClient, eng.api)
    want = c.generate([4, 8, 15, 16, 23, 42], 20).token_ids
    released = eng.info["weight_bytes"] + eng.info["kv_bytes"]
    assert released > 400 * MIB
    proc = psutil.Process(eng.pid)
    before = proc.memory_info().rss
    ctl.prepare(level=2)
    during = proc.memory_info().rss
    assert before - during >= 0.9 * released, (before, during, released)
    reply = ctl.restore()
    after = proc.memory_info().rss
    assert after >= before - 0.1 * released
    assert reply.memory.verified_tensors > 0
    assert c.generate([4, 8, 15, 16, 23, 42], 20).token_ids == want


@pytest.mark.slow
def test_a_two_gib_engine_releases_everything_and_serves_the_same_tokens(spawn_reference,
                                                                         clients):
    """A sized model of several GiB, as the benchmarks use: level 2 gives back 90% of its
    weights + KV bytes, and after the reload from its file it answers token for token."""
    eng = spawn_reference("two-gib", "--model", "2GiB", "--kv-blocks", "128")
    assert eng.info["weight_bytes"] >= 2 * 1024 * MIB and eng.info["dtype"] == "float32"
    ctl = clients(AgentClient, eng.control, timeout_s=300)
    c = clients(EngineClient, eng.api)
    want = c.generate([4, 8, 15, 16, 23, 42], 12, timeout_s=120).token_ids
    released = eng.info["weight_bytes"] + eng.info["kv_bytes"]
    proc = psutil.Process(eng.pid)
    before = proc.memory_info().rss
    reply = ctl.prepare(level=2)
    during = proc.memory_info().rss
    assert before - during >= 0.9 * released, (before, during, released)
    assert reply.memory.freed_bytes >= 0.9 * released
    back = ctl.restore()
    assert proc.memory_info().rss >= before - 0.1 * released
    assert back.memory.verified_tensors > 0
    assert c.generate([4, 8, 15, 16, 23, 42], 12, timeout_s=120).token_ids == want


def test_a_sized_model_and_a_model_file_serve(spawn_reference, uncycled, clients):
    """``--model 256MiB`` builds a float32 model of about that many weight bytes and serves;
    ``--model PATH`` serves the weights of that file, token for token."""
    sized = spawn_reference("sized", "--model", "256MiB", "--kv-blocks", "128")
    assert abs(sized.info["weight_bytes"] - 256 * MIB) < 0.1 * 256 * MIB
    assert sized.info["dtype"] == "float32"
    tokens = clients(EngineClient, sized.api).generate([3, 1, 4], 8)
    assert tokens.finish_reason == "length" and len(tokens.token_ids) == 8
    seeded = uncycled  # the tiny model, made from its seed
    want = clients(EngineClient, seeded.api).generate([2, 7, 1, 8], 12).token_ids
    from_file = spawn_reference("from-file", "--model", seeded.info["weights"])
    assert from_file.info["weights"] == seeded.info["weights"]
    assert clients(EngineClient, from_file.api).generate([2, 7, 1, 8], 12).token_ids == want
    with AgentClient(from_file.control) as ctl:
        assert set(ctl.status().registered_bytes) == {"weights", "kv_cache"}


def test_generate_and_load_commands(tiny):
    eng = tiny
    run = ckptctl
    out = run("generate", "--api", eng.api, "--prompt-ids", "1,2,3", "--max-tokens", "7", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["token_ids"]) == 7 and doc["finish_reason"] == "length"
    plain = run("generate", "--api", eng.api, "--prompt-ids", "1,2,3", "--max-tokens", "7")
    assert plain.stdout.strip() == ",".join(map(str, doc["token_ids"]))
    assert plain.stderr.strip() == "finish: length"
    assert run("generate", "--api", eng.api, "--prompt-ids", "x", "--max-tokens", "7").returncode == 2
    bad = run("generate", "--api", eng.api, "--prompt-ids", "5000", "--max-tokens", "2", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["kind"] == "UsageError"
    loads = [json.loads(run("load", "--api", eng.api, "--rate", "30", "--duration", "1",
                            "--json", "--seed", "4").stdout) for _ in range(2)]
    for load in loads:
        assert load["sent"] == 30 and load["completed"] == 30 and load["lost"] == 0, load
        assert load["aborted"] == load["rejected"] == 0 and load["lost_ids"] == []
    assert loads[0]["digest"] == loads[1]["digest"]  # same seed, same requests, same tokens
    plain = run("load", "--api", eng.api, "--rate", "20", "--duration", "0.5", "--seed", "4")
    assert plain.returncode == 0, plain.stderr
    counts, latency = plain.stdout.splitlines()
    assert counts.startswith("sent 10: completed 10, aborted 0, errored 0, rejected 0, lost 0")
    assert latency.startswith("latency p50 ")
    # requests that never end (the engine is stopped under them) are lost: exit code 1
    stopped = threading.Timer(0.5, lambda: eng.proc.send_signal(19))  # SIGSTOP
    stopped.start()
    try:
        lost = run("load", "--api", eng.api, "--rate", "20", "--duration", "1", "--settle",
                   "1", "--json")
    finally:
        stopped.join()
        eng.proc.send_signal(18)  # SIGCONT
    doc = json.loads(lost.stdout)
    assert lost.returncode == 1 and doc["lost"] > 0 and len(doc["lost_ids"]) == doc["lost"]
    assert doc["error"]["kind"] == "OperationError" and "OperationError" in lost.stderr


def test_client_abort_ends_a_request_with_its_partial_output(tiny, clients):
    eng = tiny
    c = clients(EngineClient, eng.api)
    rid = c.submit([1, 2, 3], 1000)
    while len(c.requests[rid].token_ids) < 5:
        c.poll(0.1)
    c.abort([rid])
    deadline = deadline_in(10)
    while not c.requests[rid].ended and time.monotonic() < deadline:
        c.poll(0.1)
    done = c.requests[rid]
    assert done.finish_reason == "abort" and 5 <= len(done.token_ids) < 1000
    # the aborted request holds no slot: nothing stays in flight. Not "0 at once": this
    # engine is shared, and requests an earlier test sent while it was stopped (SIGSTOP in
    # test_generate_and_load_commands) can still sit in its socket when it is handed out
    # idle, to be read now (12 once, in CI); those end by themselves
    agent = clients(AgentClient, eng.control)
    wait_until(lambda: agent.status().in_flight == 0, timeout_s=60,
               what="nothing in flight after the abort")


def test_two_keep_cycles_in_a_row_keep_outputs_exact(tiny, clients):
    """Requests kept by one cycle and resumed are in flight for the next one."""
    eng = tiny
    ctl = clients(AgentClient, eng.control, timeout_s=30)
    c = clients(EngineClient, eng.api)
    prompts = [[i, 7, 9] for i in range(6)]
    # 900 tokens each (a second or more): none can end between the status that counts them
    # and the first prepare, nor before the second one, however busy the machine
    ids = [c.submit(pr, 900) for pr in prompts]
    # all six admitted (not a fixed sleep: on a busy machine some could still be unread, and
    # be rejected by the prepare instead of kept)
    deadline = deadline_in(30)
    while ctl.status().in_flight < 6:
        assert time.monotonic() < deadline, "six requests never in flight"
        time.sleep(0.02)
    first = ctl.prepare(drain="keep", level=2)
    ctl.restore()
    second = ctl.prepare(drain="keep", level=2)
    ctl.restore()
    assert first.drain.kept == 6 and second.drain.in_flight_at_start == second.drain.kept > 0
    deadline = deadline_in(60)
    while not all(c.requests[i].ended for i in ids) and time.monotonic() < deadline:
        c.poll(0.2)
    again = [c.submit(pr, 900) for pr in prompts]  # the same six, straight through
    while not all(c.requests[i].ended for i in again) and time.monotonic() < deadline + 60:
        c.poll(0.2)
    want = [c.requests[i].token_ids for i in again]
    assert [c.requests[i].token_ids for i in ids] == want
    assert all(len(tokens) == 900 for tokens in want)


def test_a_client_that_reads_late_still_gets_every_end(tiny, clients):
    """Thousands of streamed outputs pile up while the client does not read (a script busy
    elsewhere): none may be dropped, above all not the final ones."""
    eng = tiny
    client = clients(EngineClient, eng.api)
    ids = [client.submit([9, i], 900) for i in range(16)]  # 14,400 outputs
    with AgentClient(eng.control) as agent:
        deadline = deadline_in(120)
        # all sixteen admitted first (a fixed 0.5 s could pass before the engine read them,
        # and the wait below then ended at once, with nothing piled up)
        while agent.status().in_flight < 16:
            assert time.monotonic() < deadline, "sixteen requests never in flight"
            time.sleep(0.05)
        while agent.status().in_flight:  # not reading the outputs meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.2)
    while not all(client.requests[r].ended for r in ids) and time.monotonic() < deadline:
        client.poll(0.2)
    assert [client.requests[r].finish_reason for r in ids] == ["length"] * 16
    assert [len(client.requests[r].token_ids) for r in ids] == [900] * 16


def test_an_api_endpoint_it_cannot_bind_ends_serve_with_the_typed_error(ipc_dir, model_dir):
    """``engine serve`` whose --api is an ipc path in a folder that does not exist, or a tcp
    port another socket holds: the control endpoint's bind error (``CkptError``, exit 1)
    naming the endpoint, no ready line and no traceback (it ended with zmq's raw ZMQError
    traceback); an address no host has is a ConfigError (exit 2) before torch loads."""
    import socket

    from ckpt_controller.endpoints import free_port

    holder = socket.socket()
    holder.bind(("127.0.0.1", free_port()))
    holder.listen()
    taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    cases = {f"ipc://{ipc_dir}/no-such-folder/api": ("CkptError", 1, "No such file"),
             taken: ("CkptError", 1, "in use"),
             "tcp://256.1.1.1:5": ("ConfigError", 2, "not a valid tcp://HOST:PORT")}
    runs = {api: subprocess.Popen(
        [*CKPTCTL, "engine", "serve", "--name", f"nb{i}",
         "--api", api, "--control", f"ipc://{ipc_dir}/nb{i}.ctl", "--model-dir",
         str(model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, api in enumerate(cases)}  # together: each loads torch
    try:
        for api, (kind, code, why) in cases.items():
            out, err = runs[api].communicate(timeout=scaled(120))
            assert runs[api].returncode == code, err
            assert f"ckptctl: {kind}: " in err and why in err, err
            assert f"(endpoint={api})" in err and "Traceback" not in err, err
            assert out == "", out  # no ready line
    finally:
        holder.close()
        for run in runs.values():
            run.kill()
            run.communicate()


def test_a_stopped_engine_leaves_no_socket_files(tmp_path):
    """Both ipc socket files are the owner's only (0600) while the engine runs, and SIGTERM
    ends the engine and takes them with it (zmq leaves them): the request API's and the
    agent's control endpoint's, the default one in the runtime dir included."""
    import os
    import signal
    import stat

    from ckpt_controller.procutil import ReadyProcess

    api, runtime = tmp_path / "api.sock", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    engine = ReadyProcess([*CKPTCTL, "engine", "serve", "--name", "sockets", "--api",
                           f"ipc://{api}", "--model", "tiny", "--model-dir",
                           str(tmp_path / "models")], tmp_path / "engine.log", "engine",
                          env=env, timeout_s=scaled(120))
    control = runtime / "ckpt-controller" / "sockets.sock"
    try:
        assert api.is_socket() and control.is_socket()
        assert [stat.S_IMODE(p.stat().st_mode) for p in (api, control)] == [0o600, 0o600]
        engine.proc.send_signal(signal.SIGTERM)
        assert engine.proc.wait(timeout=scaled(60)) == 0
    finally:
        engine.stop()
    assert not api.exists() and not control.exists()


def test_a_socket_file_is_removed_only_when_nobody_listens_there(tmp_path):
    import socket

    from ckpt_controller.endpoints import remove_stale_ipc

    stale, live, plain = tmp_path / "stale.sock", tmp_path / "live.sock", tmp_path / "plain"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, never listening, closed: what a stopped server leaves
    plain.write_text("not a socket")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live))
        listener.listen()  # a copy restored beside the stopped server, on the same path
        for path in (stale, live, plain):
            remove_stale_ipc(f"ipc://{path}")
        remove_stale_ipc("tcp://127.0.0.1:1")
        remove_stale_ipc("ipc://@abstract")
        remove_stale_ipc(None)
        assert not stale.exists() and live.is_socket() and plain.read_text() == "not a socket"


def test_an_engine_started_prepared_serves_after_a_restore(spawn_reference, spawn_controller):
    """``--prepare-on-startup``: PREPARED before its ready line (its KV cache released, as
    vLLM's ``--checkpoint-prepare-on-startup``), refusing requests as retryable; a controller
    takes it over as PREPARED, and after ``restore`` it answers what an engine started
    normally answers."""
    from support.config import engines_toml

    plain = spawn_reference("pso")
    with EngineClient(plain.api) as api:
        want = api.generate([9, 8, 7], 16).token_ids
    eng = spawn_reference("psp", "--prepare-on-startup")
    assert eng.info["state"] == "prepared"
    with EngineClient(eng.api) as api:
        with pytest.raises(RejectedError) as caught:
            api.generate([9, 8, 7], 16)
        assert caught.value.retryable
    ctl = spawn_controller(engines_toml(eng))
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert (status["state"], status["released_tags"], status["generation"]) == \
        ("prepared", ["kv_cache"], 0)
    out = ctl.ckptctl("restore", "psp", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    with EngineClient(eng.api) as api:
        assert api.generate([9, 8, 7], 16).token_ids == want
    status = json.loads(ctl.ckptctl("status", "--json").stdout)["engines"][0]["status"]
    assert (status["state"], status["generation"]) == ("running", 1)
