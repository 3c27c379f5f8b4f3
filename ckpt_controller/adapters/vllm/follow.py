"""A vLLM client that follows its engine across a migration, through a resolver (the fleet's
registry gives one: ``fleet.registry.Resolver``).

A migrated vLLM answers at its new node's address; the HTTP connections open at the dump do
not move (CRIU restores TCP connections only at the same IP: ``--tcp-established`` fails on
another node), so a client with a request on such a connection sees it closed when the
source's stopped copy is ended: no answer, ``EngineError(unreachable=True)`` from ``http``.
``FollowingVllm`` then asks its resolver for the engine's ``http`` endpoint again and sends
the request again there (vLLM has no resend by id: the request runs again from its prompt; a
greedy one gives the same text). With a resolver that watches (``watch``: the fleet's
registry), it does not wait for that: each request runs on a thread of its own while the
caller's waits for its answer or a change of the engine's record, and a record that names
another URL sends the request again there at once (the first attempt, stuck on the stopped
source, is left to end by itself when the source's copy is ended; its answer is dropped).
Neighbours: ``http`` (each call); ``fleet.registry`` supplies the resolver (this module knows
nothing of etcd), ``endpoints.Resolve`` its shape.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ckpt_controller.adapters.vllm.http import Completion, VllmHttp
from ckpt_controller.endpoints import WATCH_SLICE_S, Resolve, watch_changes
from ckpt_controller.errors import CkptError, EngineError

log = logging.getLogger("ckpt_controller.vllm")



class FollowingVllm:
    """Completions from the vLLM engine ``engine`` wherever the registry says it is."""

    def __init__(self, engine: str, resolve: Resolve, *, timeout_s: float = 120.0,
                 follow_for_s: float = 180.0) -> None:
        """``resolve(engine, "http")``: where the engine is now (closed with this client,
        also when it cannot be made); ``follow_for_s``: how long a request keeps being sent
        again while the engine is out of reach (moving) before its last error is raised."""
        self.resolve, self.engine = resolve, engine
        self.timeout_s, self.follow_for_s = timeout_s, follow_for_s
        try:
            self.http = VllmHttp(resolve(engine, "http"), timeout_s=timeout_s)
        except BaseException:  # policy: nothing half made is left open; raised on
            resolve.close()
            raise
        #: the URLs this client moved to, in order
        self.moves: list[str] = []
        #: what each broken attempt said (``EngineError`` messages), in order
        self.broken: list[str] = []
        #: set by the resolver's watch when the engine's record changed, if it watches
        self._changed = watch_changes(resolve, engine)

    def complete(self, prompt: str, max_tokens: int, **sampling: Any) -> Completion:
        """A greedy completion; sent again, at the URL the registry names then, while the
        engine does not answer (``follow_for_s``)."""
        end = time.monotonic() + self.follow_for_s
        while True:
            try:
                if self._changed is None:
                    return self.http.complete(prompt, max_tokens, retry_for_s=30.0, **sampling)
                done = self._until_moved(prompt, max_tokens, sampling)
                if done is not None:
                    return done
                continue  # moved: sent again at the new URL
            except EngineError as err:
                if not err.details.get("unreachable") or time.monotonic() >= end:
                    raise
                self.broken.append(str(err))
                if not self._follow():
                    time.sleep(0.5)

    def _until_moved(self, prompt: str, max_tokens: int, sampling: dict) -> Completion | None:
        """One attempt on a thread of its own: its answer (or its error, raised), or None
        when the engine's record named another URL first (this client moved there)."""
        http, box, done = self.http, [], threading.Event()

        def attempt() -> None:
            try:
                box.append(http.complete(prompt, max_tokens, retry_for_s=30.0, **sampling))
            except BaseException as exc:  # policy: handed to the caller's thread
                box.append(exc)
            done.set()

        threading.Thread(target=attempt, name=f"vllm-follow-{self.engine}",
                         daemon=True).start()
        while not done.wait(WATCH_SLICE_S):
            if self._changed.is_set():
                self._changed.clear()
                if self._follow():
                    log.info("vLLM engine %s: a request sent again at once at %s (the "
                             "registry named it)", self.engine, self.http.url)
                    return None
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _follow(self) -> bool:
        """Ask the resolver where the engine is; True when it is elsewhere (moved there)."""
        try:
            url = self.resolve(self.engine, "http")
        except CkptError as err:  # policy: the registry out of reach for now: the old URL
            log.warning("cannot look %s up in the registry: %s", self.engine, err)
            return False
        if url == self.http.url:
            return False
        log.info("vLLM engine %s moved: %s -> %s", self.engine, self.http.url, url)
        model = getattr(self.http, "_model", None)
        self.http = VllmHttp(url, timeout_s=self.timeout_s)
        if model is not None:  # the same engine: its model's name stays
            self.http._model = model
        self.moves.append(url)
        return True

    def close(self) -> None:
        self.resolve.close()

    def __enter__(self) -> "FollowingVllm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
