"""etcd v3 through its JSON gateway, over the standard library's HTTP client, with what the
fleet needs: several members tried in turn, TLS with client certificates, and one typed
error for every way etcd can be unavailable.

``Etcd`` speaks the v3 API's JSON (keys and values base64) for the calls the fleet makes:
get, range by prefix, put, delete, transactions, leases (grant, keep-alive, revoke) and
watches (a chunked answer that stays open). Each member (``_Member``) keeps its HTTP
connections open for the next call, one per caller at a time (the node's threads call at
once). A call that cannot reach a member (refused, timed out, a TLS handshake refused, HTTP
500, 503, 408 or 504: "no leader", stopping, timed out there) goes on to the next member;
when none answers it raises ``UnreachableError`` (exit 4, retryable) naming the URLs and
each one's reason. An answer etcd gives (a failed compare, an unknown lease) is not an error
here: the caller reads it; an error etcd answers with is an ``EtcdRefusedError``; an answer
that is not etcd's (another server on that port) counts as that member being away. No HTTP
proxy from the environment is used: a node talks to its cluster directly. Neighbours:
``node``, ``coordinator`` and ``registry`` (its users), ``keys`` and ``records`` (what is
stored).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckpt_controller.errors import EtcdRefusedError, UnreachableError, UsageError

log = logging.getLogger("ckpt_controller.fleet")

#: how long one request to one member may take (connect and answer)
REQUEST_TIMEOUT_S = 2.0
#: the v3 API's path on every member (etcd 3.4 and later)
API_PATH = "/v3/"
#: idle connections a member keeps for the next calls
IDLE_CONNECTIONS = 4
#: the largest answer read (the whole registry of thousands of engines is a few MiB); more is
#: a member that is not etcd
MAX_ANSWER_BYTES = 256 << 20
#: a watch's stream is read a line (one message) at a time, at most this much at once
MAX_LINE_BYTES = 1 << 20
#: a watch's stream is silent while nothing changes; TCP's keepalive tells that from a member
#: cut off without a word (a partition drops its packets, no reset comes), which held the
#: watch for ever, every change then waiting for the rounds of whoever watched: after this
#: many seconds of silence a probe, then one every interval, and after that many unanswered
#: the stream fails (25 s) and is made again on the next member
WATCH_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
#: HTTP statuses of a member that cannot answer now, tried on the next one: an internal
#: error (no leader), unavailable (stopping), a request or gateway timeout
MEMBER_AWAY = frozenset({500, 503, 408, 504})


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # the fleet's prefixes are ASCII and never end in 0xff
    return bytes(raw).decode()


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


# ---------------------------------------------------------------- transaction parts

def compare_value(key: str, value: str | bytes, result: str = "EQUAL") -> dict:
    return {"key": _b64(key), "target": "VALUE", "result": result, "value": _b64(value)}


def compare_created(key: str, revision: int = 0, result: str = "EQUAL") -> dict:
    """``create_revision(key) <result> revision``; revision 0 with EQUAL: the key is absent."""
    return {"key": _b64(key), "target": "CREATE", "result": result,
            "create_revision": str(revision)}


def compare_modified(key: str, revision: int, result: str = "EQUAL") -> dict:
    return {"key": _b64(key), "target": "MOD", "result": result, "mod_revision": str(revision)}


def put_op(key: str, value: str | bytes, lease: int = 0) -> dict:
    req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def delete_op(key: str, range_end: str | None = None) -> dict:
    """Delete ``key``, or every key from it up to ``range_end`` (``prefix_end``)."""
    req = {"key": _b64(key)}
    if range_end is not None:
        req["range_end"] = _b64(range_end)
    return {"request_delete_range": req}


def get_op(key: str) -> dict:
    return {"request_range": {"key": _b64(key)}}


class _Down(Exception):
    """This member did not answer as etcd: refused, timed out, TLS refused, ``MEMBER_AWAY``,
    or something else on that port. ``args[0]``: the reason in a few words."""


class _Refused(Exception):
    """This member answered with an error (HTTP 4xx): ``status`` and the answer's text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(status, text)
        self.status, self.text = status, text


class _Member:
    """One member's HTTP(S) connections to the v3 API: each call takes an idle one (or opens
    one) and gives it back once the answer is read, so calls from several threads each have
    their own and a quiet client reuses its connection."""

    def __init__(self, url: str, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.url, self.host, self.port = url, parts.hostname or "", parts.port or 0
        self.tls, self.timeout_s = tls, timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        """A new connection (not connected yet: the first request connects it)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _take(self) -> http.client.HTTPConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.sock is not None and not _readable(conn.sock):
                    return conn
                conn.close()  # the member closed it while it was idle (or said something)
        return self.connection()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` as JSON to the v3 API's ``path``: the JSON answer; ``_Down`` or
        ``_Refused`` otherwise."""
        conn = self._take()
        try:
            conn.request("POST", API_PATH + path.lstrip("/"), body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read(MAX_ANSWER_BYTES + 1)
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise _Down(_why_down(err)) from None
        if len(text) > MAX_ANSWER_BYTES:
            conn.close()
            raise _Down(f"not an etcd member (an answer over {MAX_ANSWER_BYTES >> 20} MiB)")
        if resp.will_close:
            conn.close()
        else:
            self._give(conn)
        return _answer(resp.status, text)

    def close(self) -> None:
        """Close the idle connections; one in use now is closed when its call ends."""
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.close()


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection's socket has something to read: its end (the member closed
    it) or bytes nobody asked for; either way it is not used again."""
    poll = select.poll()  # not select(): a node may hold descriptors past 1024
    try:
        poll.register(sock, select.POLLIN)
        return bool(poll.poll(0))
    except (OSError, ValueError):  # policy: closed under us: not usable
        return True


def _answer(status: int, raw: bytes) -> dict:
    """An HTTP answer of the gateway as its JSON document; ``_Down`` for a member that cannot
    answer now (``MEMBER_AWAY``: no leader, stopping, timed out) or an answer that is not
    etcd's, ``_Refused`` for another error etcd answers with (a 501 for a call it does not
    serve, a 4xx)."""
    text = raw.decode("utf-8", "replace")
    if status in MEMBER_AWAY:
        raise _Down(f"HTTP {status}: {_said(text) or 'no reason given'}")
    if status != 200:
        if not _from_etcd(text):
            raise _Down(f"not an etcd member (answered HTTP {status} {text[:80]!r})")
        raise _Refused(status, text)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # policy: not JSON (or nested past any record's
        doc = None  # depth, a parser bomb): not etcd's answer
    if not isinstance(doc, dict):
        raise _Down(f"not an etcd member (answered {text[:80]!r})")
    return doc


def _tls_context(ca_cert: Path | None, cert: Path | None,
                 key: Path | None) -> ssl.SSLContext:
    """A client's TLS: the server checked against ``ca_cert`` (the host's trusted CAs without
    one), and this client's certificate and key when given."""
    try:
        ctx = ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
        if cert is not None:
            ctx.load_cert_chain(str(cert), str(key) if key else None)
    except (OSError, ssl.SSLError) as err:
        raise UsageError(f"cannot use the etcd TLS files: {err}", ca=str(ca_cert or ""),
                         cert=str(cert or ""), key=str(key or "")) from None
    return ctx


class Etcd:
    """A client of one etcd cluster, given the client URLs of its members (a ``_Member``
    each); the one that last answered is tried first."""

    def __init__(self, urls: Sequence[str], *, ca_cert: Path | None = None,
                 cert: Path | None = None, key: Path | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        if not urls:
            raise UsageError("no etcd URL given")
        self.urls = tuple(u.rstrip("/") for u in urls)
        tls = None
        self._members: list[_Member] = []
        for url in self.urls:
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme not in ("http", "https") or not parts.hostname or not port:
                raise UsageError(f"not an etcd client URL: {url!r} (http:// or https://, a "
                                 "host and a port)", url=url)
            if parts.scheme == "https" and tls is None:
                tls = _tls_context(ca_cert, cert, key)
            self._members.append(_Member(url, tls if parts.scheme == "https" else None,
                                         timeout_s))
        self.timeout_s = timeout_s
        self._current = 0
        self._lock = threading.Lock()
        self._streams: set[http.client.HTTPConnection] = set()  # watches open now

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for conn in streams:  # ends the watches' blocking reads
            sock = conn.sock  # once: the watch's own thread may close it meanwhile
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # policy: already closed: nothing to end
                pass
        for member in self._members:
            member.close()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- transport

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to the v3 API's ``path`` (``kv/txn``, ...) on the first member that
        answers: its JSON answer. ``UnreachableError`` when none does, ``EtcdRefusedError``
        for an answer that is an error."""
        with self._lock:
            first = self._current
        errors = []
        for i in range(len(self._members)):
            index = (first + i) % len(self._members)
            try:
                out = self._members[index].post(path, body)
            except _Down as err:  # policy: this member is away: the next one
                errors.append(f"{self.urls[index]}: {err.args[0]}")
                continue
            except _Refused as err:  # policy: etcd answered, with an error
                raise EtcdRefusedError(f"etcd refused {path}: {_said(err.text)}",
                                       etcd=self.urls[index], said=_said(err.text)) from None
            with self._lock:
                self._current = index
            return out
        raise UnreachableError("etcd is unavailable: no member answered", etcd=list(self.urls),
                               errors=errors, retry_after_s=1.0)

    # ---------------------------------------------------------------- key-value

    @staticmethod
    def kvs(reply: dict) -> list[KeyValue]:
        """The key-values of a range answer."""
        return [KeyValue(key=_unb64(kv["key"]).decode(), value=_unb64(kv.get("value")),
                         mod_revision=int(kv.get("mod_revision", 0)),
                         create_revision=int(kv.get("create_revision", 0)),
                         lease=int(kv.get("lease", 0)))
                for kv in reply.get("kvs", [])]

    def get(self, key: str) -> KeyValue | None:
        kvs = self.kvs(self.call("kv/range", {"key": _b64(key)}))
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order."""
        return self.kvs(self.call("kv/range", {"key": _b64(prefix),
                                                "range_end": _b64(prefix_end(prefix))}))

    def changed_since(self, prefix: str, revision: int) -> tuple[list[KeyValue], int]:
        """The keys starting with ``prefix`` written after ``revision`` (all with 0), and
        the revision etcd answered at: to be given back the next time, so that a reader that
        looks again and again gets only what changed."""
        reply = self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                       "min_mod_revision": str(revision + 1)})
        return self.kvs(reply), int(reply.get("header", {}).get("revision", revision))

    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        self.call("kv/put", put_op(key, value, lease)["request_put"])

    def delete(self, key: str) -> bool:
        """Delete ``key``: whether it was there (the gateway leaves out a count of 0)."""
        return int(self.call("kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    def txn(self, compare: list[dict], success: list[dict],
            failure: Sequence[dict] = ()) -> tuple[bool, list[dict]]:
        """One transaction: ``(whether every compare held, the responses of the branch
        that ran)``; a range response's key-values come as ``KeyValue``s under ``"kvs"``."""
        reply = self.call("kv/txn", {"compare": compare, "success": success,
                                     "failure": list(failure)})
        out = []
        for r in reply.get("responses", []):
            out.append({"kvs": self.kvs(r["response_range"])} if "response_range" in r else r)
        return bool(reply.get("succeeded", False)), out

    # ---------------------------------------------------------------- watches

    def watch(self, key: str, range_end: str, on_event: Callable[[], None],
              stop: threading.Event, retry_s: float = 0.5) -> None:
        """Until ``stop`` is set: call ``on_event()`` whenever keys in ``[key, range_end)``
        change, through a watch stream on the first member that takes one; a stream that
        ends or fails (a member gone without a word too: ``WATCH_KEEPALIVE``) is made again
        (on the next member), and ``on_event`` is called then too, since changes may have
        been missed meanwhile. Blocks: run it on a thread."""
        body = json.dumps({"create_request": {"key": _b64(key),
                                              "range_end": _b64(range_end)}}).encode()
        index = 0
        while not stop.is_set():
            member = self._members[index % len(self._members)]
            index += 1
            conn = member.connection()  # a stream of its own beside the calls' connections
            with self._lock:
                self._streams.add(conn)
            try:
                conn.request("POST", API_PATH + "watch", body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                if resp.status != 200:
                    raise OSError(f"watch refused: HTTP {resp.status}")
                conn.sock.settimeout(None)  # a quiet stream is a healthy one, while its
                keep_alive(conn.sock)  # member answers TCP's keepalive probes
                on_event()  # (re)made: what changed while there was none is looked at
                while not stop.is_set():
                    line = resp.readline(MAX_LINE_BYTES)
                    if not line:
                        break  # the member ended the stream
                    if b'"events"' in line:
                        on_event()
            except Exception as err:  # policy: a stream lost or refused: made again shortly
                if stop.is_set():
                    return
                log.debug("fleet: watch of %s ended: %s", key, err)
            finally:
                with self._lock:
                    self._streams.discard(conn)
                conn.close()
            stop.wait(retry_s)

    # ---------------------------------------------------------------- leases

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": int(ttl_s), "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: its TTL now, or -1 when it has expired (or never was)."""
        reply = self.call("lease/keepalive", {"ID": lease})
        return int((reply.get("result") or {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End ``lease`` and delete every key under it (an expired one: nothing to do)."""
        try:
            self.call("kv/lease/revoke", {"ID": lease})
        except EtcdRefusedError as err:  # policy: a lease already gone is what revoke wanted
            if "lease not found" not in err.message:
                raise


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive on ``sock`` as ``WATCH_KEEPALIVE`` says (those options this system
    has)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in WATCH_KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _from_etcd(text: str) -> bool:
    """Whether an error answer is etcd's own (its gateway's JSON error, with a code)."""
    try:
        doc = json.loads(text or "")
    except (ValueError, RecursionError):  # policy: not JSON, or a parser bomb: not etcd's
        return False
    return isinstance(doc, dict) and "code" in doc


def _why_down(err: BaseException) -> str:
    """A member's failure in a few words: the TLS or OS reason when there is one."""
    if isinstance(err, ssl.SSLError):
        said = getattr(err, "verify_message", None)
        return (f"TLS handshake failed: {err.reason or err.strerror or err}"
                + (f" ({said})" if said else ""))
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, http.client.RemoteDisconnected):
        return "closed the connection without an answer"
    if isinstance(err, http.client.HTTPException):
        return f"not an etcd member (no HTTP answer: {type(err).__name__})"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _said(text: str) -> str:
    """What etcd's answer said: its JSON ``message``, else the text as it came."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):  # policy: not JSON: said as it came
        return text[:300]
    return str(doc.get("message") or text)[:300] if isinstance(doc, dict) else text[:300]
