"""A small client for a vLLM server's HTTP API: vLLM 0.34's checkpoint API
(``/checkpoint/prepare|restore|status``, mounted with ``--enable-sleep-mode``), the dev-mode
endpoints (``VLLM_SERVER_DEV_MODE=1``: pause, sleep, wake-up, collective RPC, weight
checker), which of the two a server has (``apis``), its Prometheus metrics and completions.

HTTP through the standard library (``urllib``): the sidecar runs in our environment, not
vLLM's; ``/metrics`` is read with ``prometheus_client``'s own text parser (a dependency of
ours already), so label order, escapes, timestamps and ``# TYPE`` lines are its business. Every
call has a timeout. Errors are typed: the server not answering (refused, reset, timed out)
raises ``EngineError`` with ``unreachable=True``; an HTTP error status raises ``EngineError``
with the status and the start of the body. Neighbours: ``sidecar`` (uses this to drive the
lifecycle), ``docs/vllm.md`` (the behaviours seen on a real server).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ckpt_controller.errors import EngineError, UsageError, described
from ckpt_controller.vocab import CheckpointState

#: HTTP statuses a server sends for "not now, try again" (newer vLLM while paused)
RETRYABLE = (429, 503)

_RUNNING, _WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_FINISHED = "vllm:request_success_total"  # a counter: its family is named without _total
#: the only lines handed to the parser: it is pure Python (about 35 us a line here) and a real
#: page is mostly histograms we never read; an 814-line page took 29 ms whole, 1.3 ms so
#: filtered (the regex this replaced: 0.4 ms)
_WANTED = (_RUNNING, _WAITING, "vllm:request_success")


@dataclass
class RequestMetrics:
    """Request counts from vLLM's ``/metrics`` (summed over its engines)."""

    running: int = 0
    waiting: int = 0
    #: finished requests by finish reason (stop, length, abort, error, ...), since start
    finished: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    def ended_since(self, before: "RequestMetrics", *reasons: str) -> int:
        return sum(max(0, self.finished.get(r, 0) - before.finished.get(r, 0)) for r in reasons)


def parse_metrics(text: str) -> RequestMetrics:
    """The request counts in a ``/metrics`` page, summed over vLLM's engines (label
    ``engine``); ``EngineError`` when the page is not Prometheus text."""
    # imported here: the package costs ~0.1 s, and only the sidecar's polls need it
    from prometheus_client.parser import text_string_to_metric_families

    m = RequestMetrics()
    wanted = "\n".join(line for line in text.splitlines() if any(w in line for w in _WANTED))
    try:
        samples = [s for family in text_string_to_metric_families(wanted)
                   for s in family.samples]
    except ValueError as exc:  # policy: a page we cannot read is the engine's fault, typed
        raise EngineError("vLLM's /metrics is not Prometheus text", problem=str(exc),
                          start=text[:200]) from None
    for sample in samples:
        if sample.name == _RUNNING:
            m.running += int(sample.value)
        elif sample.name == _WAITING:
            m.waiting += int(sample.value)
        elif sample.name == _FINISHED and "finished_reason" in sample.labels:
            reason = sample.labels["finished_reason"]
            m.finished[reason] = m.finished.get(reason, 0) + int(sample.value)
    return m


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    #: how many times the server said "not now" before it took the request
    rejected: int = 0
    #: the completion's ``logprobs`` object (``tokens``, ``top_logprobs``) when asked for
    logprobs: dict | None = None


class VllmHttp:
    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError("the vLLM URL must be http://HOST:PORT or https://HOST:PORT",
                             url=url)
        if parts.path not in ("", "/") or parts.query:
            raise UsageError("the vLLM URL must be the server's root, with no path or query",
                             url=url)
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                              else 80)
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ raw

    def request(self, method: str, path: str, *, params: list[tuple[str, Any]] | None = None,
                body: dict | None = None, timeout_s: float | None = None) -> Any:
        """One call; the decoded JSON answer (None for an empty one)."""
        raw = self._raw(method, path, params=params, body=body, timeout_s=timeout_s)
        try:
            return json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):  # policy: not JSON (or nested too deeply): typed
            raise EngineError(f"vLLM answered {method} {path} with something not JSON",
                              url=self.url, path=path, body=raw[:300].decode(errors="replace"))

    def _raw(self, method: str, path: str, *, params=None, body=None,
             timeout_s: float | None = None) -> bytes:
        status, raw, retry_after = self._send(method, path, params=params, body=body,
                                              timeout_s=timeout_s)
        if status >= 400:
            raise EngineError(f"vLLM answered {method} {path} with HTTP {status}",
                              url=self.url, path=path, http_status=status,
                              body=raw[:500].decode(errors="replace"),
                              retry_after=retry_after) from None
        return raw

    def _send(self, method: str, path: str, *, params=None, body=None,
              timeout_s: float | None = None, limit: int | None = None
              ) -> tuple[int, bytes, str | None]:
        """(HTTP status, body, Retry-After) of one call; an error status is an answer here.
        ``limit``: read at most this many bytes of an error's body."""
        target = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(target, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return resp.status, resp.read(), None
        except urllib.error.HTTPError as err:
            retry_after = err.headers.get("Retry-After") if err.headers else None
            return err.code, err.read(limit or 4096), retry_after
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            reason = getattr(err, "reason", err)
            raise EngineError(f"vLLM at {self.url} did not answer {method} {path}: {reason}",
                              url=self.url, path=path, unreachable=True,
                              refused=isinstance(reason, ConnectionRefusedError)) from None
        except http.client.HTTPException as err:  # policy: not HTTP (a cut answer): typed
            raise EngineError(f"vLLM at {self.url} answered {method} {path} with no HTTP "
                              f"answer: {described(err)}", url=self.url, path=path) from None

    # ------------------------------------------------------------------ state

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self._raw("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    def is_paused(self) -> bool:
        return bool(self.request("GET", "/is_paused")["is_paused"])

    def is_sleeping(self) -> bool:
        """True when paused too (vLLM's own definition): read ``is_paused`` with it."""
        return bool(self.request("GET", "/is_sleeping")["is_sleeping"])

    def metrics(self, timeout_s: float | None = None) -> RequestMetrics:
        return parse_metrics(self._raw("GET", "/metrics", timeout_s=timeout_s)
                             .decode(errors="replace"))

    def model(self) -> str:
        return self.request("GET", "/v1/models")["data"][0]["id"]

    def version(self) -> str | None:
        """vLLM's version (``GET /version``), or None when the server does not say."""
        try:
            out = self.request("GET", "/version", timeout_s=10.0)
        except EngineError as err:
            if err.details.get("unreachable"):
                raise
            return None  # policy: a server without /version is still a server
        version = out.get("version") if isinstance(out, dict) else None
        return str(version)[:64] if version is not None else None

    def apis(self) -> "Apis":
        """Which lifecycle APIs this server has: from its OpenAPI paths, or, where it serves
        no OpenAPI document (``--disable-fastapi-docs``), by asking each API's status."""
        status, raw, _ = self._send("GET", "/openapi.json", timeout_s=30.0)
        paths: set[str] | None = None
        if status == 200:
            try:
                doc = json.loads(raw)
                paths = set(doc["paths"]) if isinstance(doc.get("paths"), dict) else None
            except (ValueError, RecursionError, AttributeError, KeyError, TypeError):
                paths = None  # policy: not an OpenAPI document: ask the endpoints instead
        if paths is not None:
            return Apis(checkpoint=CHECKPOINT_PATHS <= paths, dev=DEV_PATHS <= paths,
                        version=self.version(), found_by="openapi")
        status, raw, _ = self._send("GET", "/checkpoint/status", timeout_s=10.0)
        checkpoint = status in (200, 500, 503) and _state_of(raw) is not None
        dev = self._send("GET", "/is_paused", timeout_s=10.0)[0] == 200
        return Apis(checkpoint=checkpoint, dev=dev, version=self.version(), found_by="probe")

    # ------------------------------------------------------------------ /checkpoint/*

    def checkpoint_status(self, timeout_s: float | None = None) -> "CheckpointAnswer":
        """``GET /checkpoint/status``: 200 when PREPARED, 500 when FAILED, 503 otherwise."""
        return self._checkpoint("GET", "/checkpoint/status", timeout_s=timeout_s)

    def checkpoint_prepare(self, mode: str, timeout_s: float | None = None
                           ) -> "CheckpointAnswer":
        """``POST /checkpoint/prepare?mode=``: returns once the drain began (PREPARING, or
        PREPARED at once when nothing was in flight); 400 with vLLM's refusal, nothing
        changed."""
        return self._checkpoint("POST", "/checkpoint/prepare", params=[("mode", mode)],
                                timeout_s=timeout_s)

    def checkpoint_restore(self, timeout_s: float | None = None) -> "CheckpointAnswer":
        """``POST /checkpoint/restore``: re-wakes and resumes from PREPARED (200); a no-op
        when RUNNING or RESTORING; 400 when PREPARING or FAILED."""
        return self._checkpoint("POST", "/checkpoint/restore", timeout_s=timeout_s)

    def _checkpoint(self, method: str, path: str, *, params=None,
                    timeout_s: float | None = None) -> "CheckpointAnswer":
        # a FAILED vLLM's error may be long: read past the usual error body's 4 KiB
        status, raw, _ = self._send(method, path, params=params, timeout_s=timeout_s,
                                    limit=65536)
        body = _state_of(raw)
        if body is None:
            raise EngineError(f"vLLM answered {method} {path} with HTTP {status} and no "
                              "checkpoint state", url=self.url, path=path, http_status=status,
                              body=raw[:300].decode(errors="replace"))
        return CheckpointAnswer(http_status=status, state=body[0], error=body[1])

    # ------------------------------------------------------------------ lifecycle calls

    def pause(self, mode: str, timeout_s: float | None = None) -> None:
        """``wait`` returns once in-flight requests have finished; ``abort`` and ``keep`` at
        once. New requests are queued (this vLLM) or refused as retryable (newer ones)."""
        self.request("POST", "/pause", params=[("mode", mode)], timeout_s=timeout_s)

    def resume(self) -> None:
        self.request("POST", "/resume")

    def sleep(self, level: int, mode: str, timeout_s: float | None = None) -> None:
        self.request("POST", "/sleep", params=[("level", level), ("mode", mode)],
                     timeout_s=timeout_s)

    def release_kv_cache_memory(self, timeout_s: float | None = None) -> None:
        self.request("POST", "/release_kv_cache_memory", timeout_s=timeout_s)

    def wake_up(self, tags: list[str] | None = None, timeout_s: float | None = None) -> bool:
        """Wake ``tags`` (all when None); True when fully awake (vLLM then also resumes a
        pause by itself)."""
        out = self.request("POST", "/wake_up", params=[("tags", t) for t in tags or []],
                           timeout_s=timeout_s)
        return out.get("status") == "awake"

    def collective_rpc(self, method: str, timeout_s: float | None = None) -> Any:
        return self.request("POST", "/collective_rpc", body={"method": method},
                            timeout_s=timeout_s)

    def weight_checksums(self, timeout_s: float | None = None) -> dict[str, str] | None:
        """Per-tensor digests of the loaded weights; None when this vLLM has no weight
        checker (HTTP 404)."""
        try:
            out = self.request("POST", "/weight_checker", body={"action": "checksum"},
                               timeout_s=timeout_s)
        except EngineError as err:
            if err.details.get("http_status") == 404:
                return None
            raise
        return dict(out["checksums"])

    def weight_mismatches(self, baseline: dict[str, str],
                          timeout_s: float | None = None) -> list[str]:
        out = self.request("POST", "/weight_checker",
                           body={"action": "compare", "baseline": baseline}, timeout_s=timeout_s)
        return list(out.get("mismatches", []))

    # ------------------------------------------------------------------ requests

    def complete(self, prompt: str, max_tokens: int, *, retry_for_s: float = 0.0,
                 timeout_s: float | None = None, **sampling: Any) -> Completion:
        """A greedy (temperature 0) completion. A retryable refusal (HTTP 429/503, as newer
        vLLM sends while paused) is retried, after its Retry-After or 0.2 s, for up to
        ``retry_for_s`` seconds; then the refusal is raised."""
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, **sampling}
        end = time.monotonic() + retry_for_s
        rejected = 0
        while True:
            try:
                out = self.request("POST", "/v1/completions", body=body, timeout_s=timeout_s)
            except EngineError as err:
                status = err.details.get("http_status")
                if status not in RETRYABLE or time.monotonic() >= end:
                    raise
                rejected += 1
                time.sleep(min(_retry_after(err.details.get("retry_after")),
                               max(0.0, end - time.monotonic())))
                continue
            choice = out["choices"][0]
            return Completion(text=choice["text"], finish_reason=choice.get("finish_reason"),
                              rejected=rejected, logprobs=choice.get("logprobs"))

    @property
    def model_name(self) -> str:
        if not hasattr(self, "_model"):
            self._model = self.model()
        return self._model


#: vLLM 0.34's checkpoint API, and the dev-mode endpoints the dev path needs
CHECKPOINT_PATHS = frozenset({"/checkpoint/prepare", "/checkpoint/restore",
                              "/checkpoint/status"})
DEV_PATHS = frozenset({"/pause", "/resume", "/sleep", "/wake_up", "/is_paused",
                       "/is_sleeping", "/collective_rpc"})


@dataclass(frozen=True)
class Apis:
    """The lifecycle APIs a vLLM server has: ``checkpoint`` (``/checkpoint/*``), ``dev``
    (the dev-mode endpoints); its ``version``; ``found_by`` its OpenAPI paths or probes."""

    checkpoint: bool
    dev: bool
    version: str | None = None
    found_by: str = "openapi"


@dataclass(frozen=True)
class CheckpointAnswer:
    """An answer of ``/checkpoint/*``: the HTTP status, vLLM's state and its error."""

    http_status: int
    state: CheckpointState
    error: str | None = None


def _state_of(raw: bytes) -> tuple[CheckpointState, str | None] | None:
    """``{"state": ..., "error": ...}`` as read from a ``/checkpoint/*`` body, or None."""
    try:
        body = json.loads(raw)
        state = CheckpointState(body["state"])
    except (ValueError, RecursionError, KeyError, TypeError):  # policy: not such a body
        return None
    error = body.get("error")
    return state, None if error is None else str(error)[:2000]


def _retry_after(value: str | None) -> float:
    try:
        return max(0.05, min(5.0, float(value))) if value else 0.2
    except ValueError:  # an HTTP date: we do not wait that long
        return 0.2
