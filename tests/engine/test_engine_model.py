"""The reference LM itself, in this process: cache paths agree with the cache-free golden
path, weights round-trip through safetensors, and the scheduler batches and preempts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckpt_controller.engine.kv import BlockPool
from ckpt_controller.engine.model import (
    PRESETS,
    TinyLM,
    config_for,
    load_model,
    materialize,
    save_model,
)
from ckpt_controller.engine.scheduler import Request, Scheduler
from ckpt_controller.errors import ConfigError
from support.timing import deadline_in, scaled


@pytest.fixture(scope="module")
def tiny():
    m = TinyLM(PRESETS["tiny"])
    m.randomize(0)
    return m


def test_prefill_decode_and_recompute_match_the_golden_path(tiny):
    prompt = [5, 17, 300, 2]
    want = tiny.reference_tokens(prompt, 30)
    assert len(set(want)) > 10  # varied tokens, not a loop of one
    pool = BlockPool(tiny.cfg, 64)
    blocks = pool.allocate(4)
    out = [tiny.prefill(prompt, pool.kv, blocks)]
    while len(out) < 30:
        out.append(tiny.decode([(out[-1], len(prompt) + len(out) - 1, blocks)], pool.kv)[0])
    assert out == want
    assert tiny.paged_tokens(prompt, 30, pool.kv, pool.allocate(4)) == want  # the same, packaged
    # recomputing the KV cache from prompt + tokens so far continues identically
    fresh = BlockPool(tiny.cfg, 64)
    assert tiny.prefill(prompt + want[:12], fresh.kv, fresh.allocate(4)) == want[12]


def test_the_golden_checks_take_every_token_in_one_pass(tiny):
    """Teacher forcing: one cache-free pass over a prompt and its greedy continuation gives
    each greedy token, and a prefill then one decode through the KV pool gives the last two;
    a changed weight shows at the same position."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = tiny.reference_tokens(prompt, 12)
    seq = prompt + want[:-1]
    assert tiny.forced_tokens(seq, 12) == want
    pool = BlockPool(tiny.cfg, 64)
    assert tiny.paged_forced(seq, pool.kv, pool.allocate(pool.blocks_for(len(seq)))) \
        == want[-2:]
    other = TinyLM(PRESETS["tiny"])
    other.randomize(0)
    with torch.no_grad():
        other.lm_head[want[0]].mul_(-1.0)  # the first golden token is no longer picked
    assert other.forced_tokens(seq, 12)[0] != want[0]


def test_seeds_and_safetensors_round_trip(tiny, tmp_path):
    other = TinyLM(PRESETS["tiny"])
    other.randomize(0)
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), other.parameters()))
    other.randomize(1)
    assert other.reference_tokens([1, 2], 8) != tiny.reference_tokens([1, 2], 8)
    save_model(tiny, tmp_path / "w.safetensors", seed=0)
    back = load_model(tmp_path / "w.safetensors")
    assert back.cfg == tiny.cfg
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), back.parameters()))
    path = materialize("tiny", 3, tmp_path)
    assert path.name == "tiny-float64-seed3.safetensors" and materialize("tiny", 3, tmp_path) == path


def test_model_sizes_and_bad_models(tmp_path):
    cfg = config_for("1GiB")
    assert 0.9 < cfg.weight_bytes() / (1 << 30) < 1.1 and cfg.dtype == "float32"
    assert PRESETS["small"].weight_bytes() > 200 << 20
    for bad in ("huge", "12XB", "-1GiB"):
        with pytest.raises(ConfigError):
            config_for(bad)
    with pytest.raises(ConfigError, match="smallest sized model is about 184 MiB"):
        config_for("100MiB")  # not silently a model twice that size
    with pytest.raises(ConfigError):
        materialize(str(tmp_path / "missing.safetensors"), 0, tmp_path)
    (tmp_path / "foreign.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ConfigError):
        load_model(tmp_path / "foreign.safetensors")


class Recorder:
    def __init__(self) -> None:
        self.outputs: dict[str, list] = {}
        self.finished: dict[str, str] = {}

    def emit(self, client, out) -> None:
        self.outputs.setdefault(out.request_id, []).append(out)

    def finish(self, rid, reason) -> None:
        self.finished[rid] = reason


def _tokens(rec: Recorder, rid: str) -> list[int]:
    return [t for o in rec.outputs[rid] for t in o.new_token_ids]


def test_scheduler_decodes_requests_together_and_finishes_them(tiny):
    rec = Recorder()
    pool = BlockPool(tiny.cfg, 256)
    sched = Scheduler(tiny, pool, max_batch=8, emit=rec.emit, on_finish=rec.finish)
    prompts = {f"r{i}": [i + 1, 2 * i + 3, 7] for i in range(5)}
    for rid, prompt in prompts.items():
        sched.add(Request(rid, prompt, 20, None, 0.0, b""))
    sched.step()
    assert len(sched.running) == 5  # one step admitted and advanced all of them
    assert all(len(r.output) == 2 for r in sched.running)
    while sched.running:
        sched.step()
    assert rec.finished == dict.fromkeys(prompts, "length")
    for rid, prompt in prompts.items():
        assert _tokens(rec, rid) == tiny.reference_tokens(prompt, 20)
        assert rec.outputs[rid][-1].finished and rec.outputs[rid][-1].finish_reason == "length"
    assert pool.free_blocks == 256  # every block came back


def test_preemption_recomputes_and_keeps_outputs_exact(tiny):
    rec = Recorder()
    # the smallest pool (one full-length sequence: 64 blocks of 16); 8 requests of 4 + 130
    # tokens need 72 blocks together, so some are preempted and recomputed
    pool = BlockPool(tiny.cfg, 64, block_size=16)
    sched = Scheduler(tiny, pool, max_batch=8, emit=rec.emit, on_finish=rec.finish)
    prompts = {f"p{i}": [9, i, 4, 4] for i in range(8)}
    for rid, prompt in prompts.items():
        sched.add(Request(rid, prompt, 130, None, 0.0, b""))
    while len(rec.finished) < 8:
        sched.step()
    events = [e.type for outs in rec.outputs.values() for o in outs for e in o.events]
    assert "preempted" in events
    for rid, prompt in prompts.items():
        assert _tokens(rec, rid) == tiny.reference_tokens(prompt, 130)


def test_stop_token_keep_resume_and_abort(tiny):
    rec = Recorder()
    pool = BlockPool(tiny.cfg, 256)
    sched = Scheduler(tiny, pool, max_batch=8, emit=rec.emit, on_finish=rec.finish)
    ref = tiny.reference_tokens([1, 2, 3], 10)
    sched.add(Request("s", [1, 2, 3], 50, ref[4], 0.0, b""))
    sched.add(Request("k", [4, 5], 40, None, 0.0, b""))
    sched.add(Request("a", [6], 40, None, 0.0, b""))
    for _ in range(3):
        sched.step()
    sched.keep(["k"])
    assert [r.request_id for r in sched.kept] == ["k"] and sched.find("k").blocks == []
    sched.abort(["a"])
    while sched.running:
        sched.step()
    assert rec.finished == {"s": "stop", "a": "abort"}
    assert _tokens(rec, "s") == ref[:5]
    assert 0 < len(_tokens(rec, "a")) < 40
    sched.resume()
    while sched.running or sched.waiting:
        sched.step()
    assert rec.finished["k"] == "length"
    assert _tokens(rec, "k") == tiny.reference_tokens([4, 5], 40)


def test_kept_requests_resume_oldest_first_ahead_of_newer_ones(tiny):
    """Arrival time orders the restart: kept requests go back oldest first (by the arrival
    time their clients stamped), ahead of anything queued while they were kept."""
    rec = Recorder()
    pool = BlockPool(tiny.cfg, 256)
    sched = Scheduler(tiny, pool, max_batch=1, emit=rec.emit, on_finish=rec.finish)
    for rid, arrival in (("late", 30.0), ("early", 10.0), ("middle", 20.0)):
        sched.add(Request(rid, [3, 1, 4], 12, None, arrival, b""))
    sched.step()  # "late" was first in line: it is decoding, the others wait
    assert [r.request_id for r in sched.running] == ["late"]
    sched.keep(["late", "early", "middle"])
    sched.add(Request("newcomer", [2, 7], 12, None, 5.0, b""))  # queued while they were kept
    sched.resume()
    assert [r.request_id for r in sched.waiting] == ["early", "middle", "late", "newcomer"]
    first_token_order = []
    while sched.running or sched.waiting:
        sched.step()
        for r in sched.running:
            if r.request_id not in first_token_order:
                first_token_order.append(r.request_id)
    assert first_token_order == ["early", "middle", "late", "newcomer"]
    for rid, prompt in (("early", [3, 1, 4]), ("late", [3, 1, 4]), ("newcomer", [2, 7])):
        assert rec.finished[rid] == "length"
        assert _tokens(rec, rid) == tiny.reference_tokens(prompt, 12), rid


class CommandInPrefill:
    """Wraps the real model; during its first prefill another thread's command arrives."""

    def __init__(self, model: TinyLM, sched_ref: list, command) -> None:
        self.model, self.cfg, self.sched_ref, self.command = model, model.cfg, sched_ref, command
        self.prefilled: list[int] = []

    def prefill(self, tokens, *a):
        if not self.prefilled:
            self.sched_ref[0].submit(self.command)
        self.prefilled.append(tokens[0])
        return self.model.prefill(tokens, *a)

    def decode(self, *a):
        return self.model.decode(*a)


def test_a_command_waits_for_one_prefill_not_for_a_whole_burst(tiny):
    """A step that admits several requests runs what was submitted meanwhile between two
    prefills: a resend or a hook waits for one, not for all (after a resume, the kept
    requests' context is computed again, request by request)."""
    rec = Recorder()
    ran_after: list[int] = []
    sched_ref: list = []
    model = CommandInPrefill(tiny, sched_ref, lambda: ran_after.append(len(model.prefilled)))
    sched = Scheduler(model, BlockPool(tiny.cfg, 256), max_batch=8, emit=rec.emit,
                      on_finish=rec.finish)
    sched_ref.append(sched)
    for i in range(4):
        sched.add(Request(f"r{i}", [i + 1, 5, 9], 12, None, float(i), b""))
    sched.step()
    assert ran_after == [1]  # after the first prefill, before the three others
    assert len(sched.running) == 4 and all(len(r.output) == 2 for r in sched.running)
    while sched.running:
        sched.step()
    for i in range(4):
        assert _tokens(rec, f"r{i}") == tiny.reference_tokens([i + 1, 5, 9], 12)


def test_a_pause_between_two_prefills_ends_the_step_and_loses_nothing(tiny):
    rec = Recorder()
    sched_ref: list = []
    model = CommandInPrefill(tiny, sched_ref, lambda: setattr(sched_ref[0], "paused", True))
    sched = Scheduler(model, BlockPool(tiny.cfg, 256), max_batch=8, emit=rec.emit,
                      on_finish=rec.finish)
    sched_ref.append(sched)
    for i in range(3):
        sched.add(Request(f"r{i}", [i + 2, 4], 10, None, float(i), b""))
    sched.step()
    # paused after the first prefill: no other prefill, no decode
    assert model.prefilled == [2]
    assert [len(r.output) for r in sched.running] == [1] and len(sched.waiting) == 2
    assert not sched.has_work()
    sched.keep(["r0", "r1", "r2"])
    sched.resume()
    while sched.running or sched.waiting:
        sched.step()
    for i in range(3):
        assert rec.finished[f"r{i}"] == "length"
        assert _tokens(rec, f"r{i}") == tiny.reference_tokens([i + 2, 4], 10)


class BrokenOnce:
    """Wraps the real model; its next decode raises (a failed kernel, say)."""

    def __init__(self, model: TinyLM) -> None:
        self.model, self.cfg, self.armed = model, model.cfg, True

    def prefill(self, *a):
        return self.model.prefill(*a)

    def decode(self, *a):
        if self.armed:
            self.armed = False
            raise RuntimeError("decode blew up")
        return self.model.decode(*a)


def test_a_failed_step_ends_requests_with_error_and_the_loop_goes_on(tiny):
    rec = Recorder()
    sched = Scheduler(BrokenOnce(tiny), BlockPool(tiny.cfg, 256), max_batch=8, emit=rec.emit,
                      on_finish=rec.finish)
    stop = threading.Event()
    loop = threading.Thread(target=sched.run_loop,
                            args=(stop, lambda exc: sched.fail_all(repr(exc))))
    loop.start()
    try:
        sched.submit(lambda: sched.add(Request("x", [1, 2], 10, None, 0.0, b""))).result(5)
        deadline = deadline_in(10)
        while "x" not in rec.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.finished["x"] == "error"
        assert "decode blew up" in rec.outputs["x"][-1].error
        sched.submit(lambda: sched.add(Request("y", [1, 2], 10, None, 0.0, b""))).result(5)
        while "y" not in rec.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.finished["y"] == "length"
        assert sched.submit(lambda: 41 + 1).result(5) == 42
    finally:
        stop.set()
        loop.join(scaled(5))


def test_golden_mismatch_fails_the_restore(tmp_path, ipc_dir):
    """An engine whose weights changed behind the registry's back (level 0 keeps no
    checksum) is caught by the golden prompt before it is re-admitted."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.engine.client import EngineClient
    from ckpt_controller.engine.server import EngineOptions, ReferenceEngine
    from ckpt_controller.errors import RejectedError, VerificationError

    eng = ReferenceEngine(EngineOptions(name="gold", api=f"ipc://{ipc_dir}/g.api",
                                        control=f"ipc://{ipc_dir}/g.ctl", model_dir=tmp_path))
    eng.start()
    try:
        with AgentClient(eng.agent.endpoint) as ctl:
            ctl.prepare(level=0)
            ctl.restore()  # untouched: golden matches
            ctl.prepare(level=0)
            with torch.no_grad():
                eng.model.lm_head.mul_(-1.0)
            with pytest.raises(VerificationError) as info:
                ctl.restore()
            assert info.value.details["state"] == "failed"
            assert "golden" in info.value.message and info.value.details["path"] == "cache-free"
            assert ctl.status().state == "failed"
            with EngineClient(f"ipc://{ipc_dir}/g.api") as api:  # admission stayed closed
                with pytest.raises(RejectedError) as rejected:
                    api.generate([1, 2, 3], 4)
                assert rejected.value.details["state"] == "failed"
    finally:
        eng.stop()


def test_a_kv_path_that_computes_otherwise_fails_the_restore(tmp_path, ipc_dir, monkeypatch):
    """The weights check out and the cache-free golden path agrees, but the path requests
    take (prefill and decode through the re-woken KV pool) does not: the restore fails."""
    from ckpt_controller.agent import AgentClient
    from ckpt_controller.engine.server import EngineOptions, ReferenceEngine
    from ckpt_controller.errors import VerificationError

    eng = ReferenceEngine(EngineOptions(name="kvg", api=f"ipc://{ipc_dir}/kvg.api",
                                        control=f"ipc://{ipc_dir}/kvg.ctl", model_dir=tmp_path))
    eng.start()
    try:
        with AgentClient(eng.agent.endpoint) as ctl:
            forced = eng.model.forced_tokens
            calls = []
            monkeypatch.setattr(eng.model, "forced_tokens",
                                lambda *a: calls.append(a) or forced(*a))
            ctl.prepare(level=1)  # the KV pool is discarded and comes back zero-filled
            ctl.restore()  # the paged golden path recomputes its blocks: it matches
            assert calls == []  # so the cache-free pass, there to tell which path, never ran
            ctl.prepare(level=1)
            decode = eng.model.decode
            monkeypatch.setattr(eng.model, "decode",
                                lambda batch, kv: [t + 1 for t in decode(batch, kv)])
            with pytest.raises(VerificationError) as info:
                ctl.restore()
            assert info.value.details["path"] == "kv_cache"
            assert info.value.details["expected"] == eng.golden_paged
            assert len(calls) == 1  # the cache-free path agreed: the KV path is named
            assert ctl.status().state == "failed"
    finally:
        eng.stop()


def test_a_failed_prefill_ends_the_request_with_error(tiny):
    class BrokenPrefill(BrokenOnce):
        def prefill(self, *a):
            raise RuntimeError("prefill blew up")

    rec = Recorder()
    sched = Scheduler(BrokenPrefill(tiny), BlockPool(tiny.cfg, 256), max_batch=8,
                      emit=rec.emit, on_finish=rec.finish)
    sched.add(Request("x", [1, 2], 10, None, 0.0, b""))
    with pytest.raises(RuntimeError):
        sched.step()
    sched.fail_all("prefill blew up")
    assert rec.finished == {"x": "error"} and sched.pool.free_blocks == 256


def test_the_final_output_repairs_deltas_lost_with_a_connection(tmp_path):
    # a checkpoint with --tcp-close can lose deltas still in the socket at dump time; the end
    # is sent after the restore and carries the whole output
    from ckpt_controller.engine import api
    from ckpt_controller.engine.client import Completion, EngineClient

    with EngineClient(f"ipc://{tmp_path}/nobody") as client:
        c = client.requests["r1"] = Completion(request_id="r1")
        client._take(api.RequestOutput(request_id="r1", new_token_ids=[5]))
        # the delta [6] was lost; then the end
        client._take(api.RequestOutput(request_id="r1", new_token_ids=[7], finished=True,
                                       finish_reason="length", token_ids=[5, 6, 7]))
        assert c.token_ids == [5, 6, 7] and c.repaired and c.finish_reason == "length"
        d = client.requests["r2"] = Completion(request_id="r2")
        client._take(api.RequestOutput(request_id="r2", new_token_ids=[1]))
        client._take(api.RequestOutput(request_id="r2", new_token_ids=[2], finished=True,
                                       finish_reason="stop", token_ids=[1, 2]))
        assert d.token_ids == [1, 2] and not d.repaired
