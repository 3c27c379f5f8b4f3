"""etcd v3 through its JSON gateway (``etcd3gw``'s HTTP session), with what the fleet needs:
several members tried in turn, TLS with client certificates, and one typed error for every
way etcd can be unavailable.

``Etcd`` speaks the v3 API's JSON (keys and values base64) for the calls the fleet makes:
get, range by prefix, put, delete, transactions, and leases (grant, keep-alive, revoke). A
call that cannot reach a member (refused, timed out, a 5xx such as "no leader") goes on to
the next member; when none answers it raises ``UnreachableError`` (exit 4, retryable) naming
the URLs. An answer etcd gives (a failed compare, an unknown lease) is not an error here: the
caller reads it; an error etcd answers with is an ``EtcdRefusedError``. Neighbours: ``node``,
``coordinator`` and ``registry`` (its users), ``keys`` and ``records`` (what is stored).
"""

from __future__ import annotations

import base64
import logging
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


class Etcd:
    """A client of one etcd cluster, given the client URLs of its members: an
    ``etcd3gw.Etcd3Client`` per member, the one that last answered tried first."""

    def __init__(self, urls: Sequence[str], *, ca_cert: Path | None = None,
                 cert: Path | None = None, key: Path | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        import etcd3gw  # loaded with the fleet layer only

        if not urls:
            raise UsageError("no etcd URL given")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._members = []
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
                raise UsageError(f"not an etcd client URL: {url!r} (http:// or https://, a "
                                 "host and a port)", url=url)
            self._members.append(etcd3gw.Etcd3Client(
                host=parts.hostname, port=parts.port, protocol=parts.scheme,
                ca_cert=str(ca_cert) if ca_cert else None,
                cert_cert=str(cert) if cert else None, cert_key=str(key) if key else None,
                timeout=timeout_s, api_path="/v3/"))  # etcd 3.4 and later serve /v3/
            # etcd is reached directly: an HTTP proxy from the environment would sit between a
            # node and its cluster (and answer for members that are not there)
            self._members[-1].session.trust_env = False
        self.timeout_s = timeout_s
        self._current = 0
        self._lock = threading.Lock()
        self._streams: set = set()  # watch streams open now (closed by ``close``)

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for resp in streams:  # ends the watches' blocking reads
            try:
                sock = resp.raw.connection.sock
                if sock is not None:
                    sock.shutdown(2)
            except Exception:  # policy: already closed, or no socket to reach: nothing to end
                pass
        for member in self._members:
            member.session.close()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- transport

    def _each(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(member client)`` on the first member that answers; raises
        ``UnreachableError`` when none does, ``EtcdRefusedError`` for an answer that is an error."""
        from etcd3gw import exceptions as ex

        with self._lock:
            first = self._current
        errors = []
        for i in range(len(self._members)):
            index = (first + i) % len(self._members)
            try:
                out = fn(self._members[index])
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError,
                    ex.InternalServerError) as err:  # policy: this member is down: the next
                errors.append(f"{self.urls[index]}: {_why_down(err)}")
                continue
            except ex.Etcd3Exception as err:
                if not _from_etcd(err):  # policy: something else answered: not a member
                    errors.append(f"{self.urls[index]}: not an etcd member (answered "
                                  f"{(err.args or ('?',))[0]!r})")
                    continue
                # policy: etcd answered, with an error
                raise EtcdRefusedError(f"etcd refused {what}: {_said(err)}", etcd=self.urls[index],
                                  said=_said(err)) from None
            with self._lock:
                self._current = index
            return out
        raise UnreachableError("etcd is unavailable: no member answered", etcd=list(self.urls),
                               errors=errors, retry_after_s=1.0)

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to the v3 API's ``path`` (``kv/txn``, ...): its JSON answer."""
        return self._each(path, lambda m: m.post(m.get_url(path), json=body))

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

    def put(self, key: str, value: str | bytes, lease: int = 0) -> None:
        self.call("kv/put", put_op(key, value, lease)["request_put"])

    def delete(self, key: str) -> bool:
        return self._each("delete", lambda m: m.delete(key))

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
        ends or fails is made again (on the next member), and ``on_event`` is called then
        too, since changes may have been missed meanwhile. Blocks: run it on a thread."""
        import requests

        body = {"create_request": {"key": _b64(key), "range_end": _b64(range_end)}}
        index = 0
        while not stop.is_set():
            member = self._members[index % len(self._members)]
            index += 1
            session = requests.Session()  # a stream of its own beside the calls' connections
            session.trust_env = False
            session.verify, session.cert = member.session.verify, member.session.cert
            try:
                resp = session.post(member.get_url("/watch"), json=body, stream=True,
                                    timeout=(self.timeout_s, None))
                with self._lock:
                    self._streams.add(resp)
                try:
                    if resp.status_code != 200:
                        raise OSError(f"watch refused: HTTP {resp.status_code}")
                    on_event()  # (re)made: what changed while there was none is looked at
                    for line in resp.iter_lines():
                        if stop.is_set():
                            return
                        if line and b'"events"' in line:
                            on_event()
                finally:
                    with self._lock:
                        self._streams.discard(resp)
                    resp.close()
            except Exception as err:  # policy: a stream lost or refused: made again shortly
                if stop.is_set():
                    return
                log.debug("fleet: watch of %s ended: %s", key, err)
            finally:
                session.close()
            stop.wait(retry_s)

    # ---------------------------------------------------------------- leases

    def grant(self, ttl_s: int) -> int:
        return self._each("lease grant", lambda m: m.lease(int(ttl_s)).id)

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: its TTL now, or -1 when it has expired (or never was)."""
        from etcd3gw.lease import Lease

        return self._each("lease keep-alive", lambda m: Lease(lease, m).refresh())

    def revoke(self, lease: int) -> None:
        """End ``lease`` and delete every key under it (an expired one: nothing to do)."""
        from etcd3gw.lease import Lease

        try:
            self._each("lease revoke", lambda m: Lease(lease, m).revoke())
        except EtcdRefusedError as err:  # policy: a lease already gone is what revoke wanted
            if "lease not found" not in err.message:
                raise


def _from_etcd(err: Exception) -> bool:
    """Whether an error answer is etcd's own (its gateway's JSON error, with a code)."""
    import json

    try:
        return "code" in json.loads(getattr(err, "detail_text", None) or "")
    except (ValueError, TypeError):
        return False


def _why_down(err: Exception) -> str:
    """A member's failure in a few words: the OS's reason when there is one."""
    import re

    text = " ".join(str(a) for a in err.args) or _said(err)
    tls = re.search(r"SSLError\(\w+\((?:\d+, )?['\"]([^'\"]+)", text)
    if tls:  # the server refused our certificate (or sent none we trust)
        return f"TLS handshake failed: {tls.group(1)}"
    found = re.search(r"\[Errno \d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    if "timed out" in text.lower() or "Timeout" in type(err).__name__:
        return "timed out"
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def _said(err: Exception) -> str:
    """What etcd's answer said: its JSON ``message``, else the text as it came."""
    import json

    text = getattr(err, "detail_text", None) or ""
    try:
        return str(json.loads(text).get("message") or text)[:300]
    except (ValueError, AttributeError):
        return text[:300]
