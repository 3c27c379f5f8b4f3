"""A small real engine for the agent's tests: requests that take steps over real weights.

Not the reference LM (that is ``ckpt_controller.engine``): this process only needs what the
agent drives, with nothing else in the way. It holds torch weights (an ``nn.Module``, saved to
a safetensors source) and a KV tensor, both registered with a ``MemoryRegistry``; a request is
N steps, each step reads the weights and writes the KV tensor, and its output is the list of
per-step values, so a request kept across a cycle must end with the same output as one that
ran straight through. Request API: a ROUTER speaking msgpack dicts:

    {"op": "add", "id": str, "steps": int, "seed": int} -> later {"id", "status": "finished", "reason", "output"}
                                                 or at once {"id", "status": "rejected", ...}
    {"op": "introspect"}                       -> {"param_ids", "storage_ptrs", "weights_sha256", "rss"}

Prints one JSON ready line on stdout once both endpoints are bound.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import msgspec
import psutil
import torch
import zmq

from ckpt_controller.agent import Agent, EngineHooks
from ckpt_controller.errors import RejectedError
from ckpt_controller.memory import MemoryRegistry, save_file

MIB = 1 << 20


class Weights(torch.nn.Module):
    def __init__(self, n: int, rows: int, cols: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rows, cols, generator=g), requires_grad=False)
            for _ in range(n)
        )


class StepEngine(EngineHooks):
    def __init__(self, args: argparse.Namespace) -> None:
        cols = 1024
        rows = max(1, args.weights_mib * MIB // (args.layers * cols * 4))
        self.model = Weights(args.layers, rows, cols, args.seed)
        self.kv = torch.zeros(args.kv_mib * MIB // 4, dtype=torch.float32)
        self.kv.fill_(1.0)  # touched: its pages count in RSS like a live KV cache
        source = Path(args.dir) / "weights.safetensors"
        save_file(dict(self.model.named_parameters()), source)
        self.registry = MemoryRegistry()
        self.registry.register("weights", self.model, source=source)
        self.registry.register("kv_cache", {"kv": self.kv})
        self.step_s = args.step_s
        self.lock = threading.Lock()
        self.active: dict[str, dict] = {}
        self.kept: dict[str, dict] = {}
        self.paused = False
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.golden = self._golden()
        self.agent = Agent(args.name, hooks=self, memory=self.registry, control=args.control,
                           heartbeat_interval_s=args.heartbeat_s)

    # ---------------------------------------------------------------- the work

    def _value(self, step: int, seed: int) -> float:
        layers = self.model.layers
        w = layers[(step + seed) % len(layers)]
        row = w[(step * 31 + seed) % w.shape[0]]
        return float((row * layers[(step + 1) % len(layers)][seed % w.shape[0]]).sum())

    def _golden(self) -> list[float]:
        return [self._value(k, 7) for k in range(4)]

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                if not self.paused:
                    for rid, req in list(self.active.items()):
                        k = len(req["output"])
                        req["output"].append(self._value(k, req["seed"]))
                        self.kv[k % self.kv.numel()] = req["output"][-1]
                        if len(req["output"]) >= req["steps"]:
                            del self.active[rid]
                            self._end(rid, req, "length")
            time.sleep(self.step_s)

    def _end(self, rid: str, req: dict, reason: str) -> None:
        self.agent.gate.finish(rid, reason)  # booked before the client can see the end
        self.outbox.put((req["client"], {"id": rid, "status": "finished", "reason": reason,
                                         "output": req["output"]}))

    # ---------------------------------------------------------------- hooks

    def abort_requests(self, request_ids: list[str]) -> None:
        with self.lock:
            for rid in request_ids:
                req = self.active.pop(rid, None)
                if req is not None:
                    self._end(rid, req, "abort")

    def keep_requests(self, request_ids: list[str]) -> None:
        with self.lock:
            for rid in request_ids:
                if rid in self.active:
                    self.kept[rid] = self.active.pop(rid)

    def pause_scheduling(self) -> None:
        with self.lock:  # the step in progress, if any, has ended
            self.paused = True

    def resume_scheduling(self) -> None:
        with self.lock:
            self.active.update(self.kept)
            self.kept.clear()
            self.paused = False

    def verify(self) -> None:
        got = self._golden()
        if got != self.golden:
            raise RuntimeError(f"golden outputs differ: {got} != {self.golden}")

    # ---------------------------------------------------------------- request API

    def introspect(self) -> dict:
        params = list(self.model.parameters())
        sha = hashlib.sha256()
        for prm in params:
            # a clone: exporting the parameter itself (.numpy()) would pin its storage
            sha.update(prm.detach().clone().view(torch.uint8).numpy().tobytes())
        return {"param_ids": [id(x) for x in params],
                "storage_ptrs": [x.untyped_storage().data_ptr() for x in params],
                "weights_sha256": sha.hexdigest(),
                "rss": psutil.Process().memory_info().rss}

    def serve_api(self, sock: zmq.Socket, stop: threading.Event) -> None:
        while not stop.is_set():
            while True:
                try:
                    client, msg = self.outbox.get_nowait()
                except queue.Empty:
                    break
                sock.send_multipart([client, msgspec.msgpack.encode(msg)])
            if not sock.poll(5):
                continue
            client, payload = sock.recv_multipart()
            msg = msgspec.msgpack.decode(payload)
            if msg["op"] == "introspect":
                reply = self.introspect()
            else:
                try:
                    with self.lock:
                        self.agent.gate.admit(msg["id"])
                        self.active[msg["id"]] = {"steps": msg["steps"], "output": [],
                                                  "seed": msg.get("seed", 0), "client": client}
                    continue
                except RejectedError as err:
                    reply = {"id": msg["id"], "status": "rejected", **err.details}
            sock.send_multipart([client, msgspec.msgpack.encode(reply)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--api", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--weights-mib", type=int, default=192)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=0.01)
    ap.add_argument("--heartbeat-s", type=float, default=0.2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = StepEngine(args)
    ctx = zmq.Context()
    api = ctx.socket(zmq.ROUTER)
    api.bind(args.api)
    engine.agent.start()
    stop = threading.Event()
    threading.Thread(target=engine.loop, args=(stop,), daemon=True).start()
    print(json.dumps({"event": "ready", "pid": os.getpid(), "control": engine.agent.endpoint,
                      "api": args.api}), flush=True)
    try:
        engine.serve_api(api, stop)
    finally:
        stop.set()
        engine.agent.close()
        api.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
