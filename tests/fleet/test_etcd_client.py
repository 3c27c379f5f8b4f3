"""``fleet/etcd.py`` against stand-in HTTP members (no etcd needed): a member away, one that is
not etcd, a 5xx, an error etcd answers with, a member that never answers, a connection the
member closed while idle, a hostile answer, and the watch stream. The real etcd runs under
``-m fleet`` (tests/fleet/test_fleet.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from ckpt_controller.errors import EtcdRefusedError, UnreachableError, UsageError
from ckpt_controller.fleet import etcd
from ckpt_controller.fleet.etcd import Etcd, _b64
from support.net import LocalHttp
from support.timing import scaled, wait_until


class Member:
    """An HTTP server on 127.0.0.1 answering each POST with ``answer(path, body)``:
    ``(status, body)``; keeps connections alive (HTTP/1.1) unless told to close them."""

    def __init__(self, answer) -> None:
        self.answer, self.paths, self.connections = answer, [], 0
        self.hang_up = False  # after each answer, close the connection without saying so
        member = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                member.connections += 1

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                member.paths.append(self.path)
                status, out = member.answer(self.path, body)
                raw = out if isinstance(out, bytes) else json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
                self.close_connection = member.hang_up

            def log_message(self, *args) -> None:
                pass

        self.http = LocalHttp(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def members():
    made = []

    def make(answer):
        made.append(Member(answer))
        return made[-1]

    yield make
    for m in made:
        m.close()


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def kv(key: str, value: str) -> dict:
    return {"kvs": [{"key": _b64(key), "value": _b64(value), "mod_revision": "7",
                     "create_revision": "3"}]}


def test_calls_reach_the_member_that_answers_and_reuse_its_connection(members):
    good = members(lambda path, body: (200, kv("a", "1") if path == "/v3/kv/range" else {}))
    with Etcd([closed_port(), good.url]) as c:
        got = c.get("a")
        assert (got.key, got.value, got.mod_revision, got.create_revision) == ("a", b"1", 7, 3)
        c.put("a", "2")
        assert c.get("a").value == b"1"
    assert good.paths == ["/v3/kv/range", "/v3/kv/put", "/v3/kv/range"]
    assert good.connections == 1  # the one that answered is tried first, its connection kept
    c.put("a", "3")  # after close (another thread's call ending late): answered, not kept
    assert c._members[1]._idle == [] and good.connections == 2


def test_no_member_answers_each_reason_is_said(members):
    html = members(lambda path, body: (404, b"<html>not found</html>"))
    plain = members(lambda path, body: (200, b"hello"))
    leaderless = members(lambda path, body: (
        503, {"error": "etcdserver: no leader", "code": 14, "message": "etcdserver: no leader"}))
    away = closed_port()
    with Etcd([away, html.url, plain.url, leaderless.url]) as c, \
            pytest.raises(UnreachableError) as got:
        c.get("a")
    errors = got.value.details["errors"]
    assert errors[0] == f"{away}: Connection refused"
    assert errors[1].startswith(f"{html.url}: not an etcd member (answered HTTP 404")
    assert errors[2].startswith(f"{plain.url}: not an etcd member (answered 'hello'")
    assert errors[3] == f"{leaderless.url}: HTTP 503: etcdserver: no leader"
    assert got.value.details["retry_after_s"] == 1.0


def test_a_timeout_is_tried_elsewhere_and_a_call_etcd_does_not_serve_is_refused(members):
    """etcd's gateway answers 408/504 for a request that timed out (the next member may
    answer) and 501 for a call it does not serve (every member would say the same)."""
    timed_out = members(lambda path, body: (
        408, {"error": "context canceled", "code": 1, "message": "context canceled"}))
    other = members(lambda path, body: (200, kv("a", "1") if path == "/v3/kv/range" else (
        501, {"error": "unknown", "code": 12, "message": "method not implemented"})))
    with Etcd([timed_out.url, other.url]) as c:
        assert c.get("a").value == b"1"
    unsupported = members(lambda path, body: (
        501, {"error": "unknown", "code": 12, "message": "method not implemented"}))
    with Etcd([unsupported.url, other.url]) as c, \
            pytest.raises(EtcdRefusedError, match="method not implemented"):
        c.get("a")
    assert other.paths == ["/v3/kv/range"]


def test_close_ends_a_watch_whose_thread_closes_it_meanwhile():
    """``close`` reads a watch's socket once: the watch's own thread may close its
    connection (``sock`` then None) between a look and a use."""
    class Closing:
        def __init__(self) -> None:
            self.looks, self.held = 0, socket.socket()

        @property
        def sock(self):
            self.looks += 1
            return self.held if self.looks == 1 else None

    c = Etcd(["http://127.0.0.1:1"])
    stream = Closing()
    c._streams.add(stream)
    try:
        c.close()
    finally:
        stream.held.close()
    assert stream.looks == 1


def test_an_error_etcd_answers_with_is_refused_not_retried_elsewhere(members):
    refusing = members(lambda path, body: (
        400, {"error": "etcdserver: requested lease not found", "code": 5,
              "message": "etcdserver: requested lease not found"}))
    other = members(lambda path, body: (200, {}))
    with Etcd([refusing.url, other.url]) as c:
        with pytest.raises(EtcdRefusedError, match="requested lease not found"):
            c.keepalive(42)
        c.revoke(42)  # a lease already gone is what revoke wanted
    assert other.paths == []


def test_a_member_that_never_answers_times_out_within_the_timeout():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel does), never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with Etcd([url], timeout_s=0.3) as c, pytest.raises(UnreachableError) as got:
            c.get("a")
        assert time.monotonic() - t0 < scaled(2.0)
        assert got.value.details["errors"] == [f"{url}: timed out"]
    finally:
        silent.close()


def test_a_connection_the_member_closed_while_idle_is_not_used_again(members):
    """The member hangs up after each answer without saying so (an idle timeout, a member
    restarted): the next call notices before it writes and opens another connection."""
    m = members(lambda path, body: (200, {"header": {}}))
    m.hang_up = True
    with Etcd([m.url]) as c:
        for i in range(3):
            c.put("a", str(i))
            wait_until(lambda: m.connections == i + 1, what="the member's connection")
            time.sleep(0.05)  # its hang-up reaches this side
    assert m.paths == ["/v3/kv/put"] * 3
    assert m.connections == 3


def test_answers_are_read_as_the_gateway_gives_them(members):
    def answer(path, body):
        if path == "/v3/kv/deleterange":
            return 200, ({"deleted": "1"} if body["key"] == _b64("there") else {"header": {}})
        if path == "/v3/lease/keepalive":
            return 200, {"result": {"ID": str(body["ID"]), "TTL": "9"}} if body["ID"] == 1 \
                else {"result": {"ID": str(body["ID"])}}
        if path == "/v3/lease/grant":
            return 200, {"ID": "7587862", "TTL": str(body["TTL"])}
        if path == "/v3/kv/txn":
            return 200, {"succeeded": True, "responses": [{"response_range": kv("k", "v")},
                                                          {"response_put": {}}]}
        return 404, b""

    m = members(answer)
    with Etcd([m.url]) as c:
        assert c.delete("there") is True and c.delete("gone") is False
        assert c.keepalive(1) == 9 and c.keepalive(2) == -1  # an expired lease: no TTL
        assert c.grant(5) == 7587862
        ok, out = c.txn([], [])
        assert ok and out[0]["kvs"][0].value == b"v" and out[1] == {"response_put": {}}


def test_a_hostile_answer_is_a_member_that_is_not_etcd(members, monkeypatch):
    """Deeply nested JSON (a recursion bomb for a parser), a list, garbage bytes, an answer
    past the size etcd's could have: each is said as not etcd, never a traceback."""
    monkeypatch.setattr(etcd, "MAX_ANSWER_BYTES", 1 << 20)
    bombs = [b"[" * 200_000 + b"]" * 200_000, b"[1, 2]", bytes(range(256)),
             b'{"kvs": "' + b"x" * (2 << 20) + b'"}']
    hostile = [members(lambda path, body, b=b: (200, b)) for b in bombs]
    hostile.append(members(lambda path, body: (400, b'{"code":' + b"[" * 200_000)))
    with Etcd([m.url for m in hostile]) as c, pytest.raises(UnreachableError) as got:
        c.get("a")
    errors = got.value.details["errors"]
    assert len(errors) == 5 and all("not an etcd member" in e for e in errors), errors
    assert "over 1 MiB" in errors[3]


def _stream(lines: list[bytes], posts: list[float] | None = None) -> type:
    """A stand-in gateway's watch: each POST answered with ``lines`` (chunked), then the
    stream stays open and quiet; each POST's time noted in ``posts``."""
    class Stream(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if posts is not None:
                posts.append(time.monotonic())
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in lines:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            time.sleep(60)  # the stream stays open, quiet

        def log_message(self, *args) -> None:
            pass

    return Stream


def test_the_watch_calls_back_per_change_and_ends_at_close():
    """A stand-in gateway streams one line per message (chunked); ``on_event`` runs once as
    the stream is made and once per line with events; ``close`` ends the blocking read."""
    server = LocalHttp(_stream([b'{"result":{"header":{},"created":true}}\n',
                                b'{"result":{"header":{},"events":[{"kv":{}}]}}\n',
                                b'{"result":{"header":{},"events":[{"kv":{}}]}}\n']))
    events, stop = [], threading.Event()
    c = Etcd([server.url])
    t = threading.Thread(target=c.watch, args=("a", "b", lambda: events.append(1), stop))
    try:
        t.start()
        wait_until(lambda: len(events) == 3, what="the stream made and two changes seen")
        time.sleep(0.1)
        assert len(events) == 3  # the quiet stream calls nothing more
        stop.set()
        c.close()
        t.join(timeout=scaled(5))
        assert not t.is_alive()
    finally:
        stop.set()
        c.close()
        server.close()


def test_a_quiet_watch_stays_and_its_member_is_probed_by_tcp_keepalive():
    """A member cut off without a word (a partition: no reset, no data) once held a watch for
    ever. The stream's socket sends TCP keepalive probes (``WATCH_KEEPALIVE``: it fails 25 s
    after the member stops answering them, seen here with a veth link taken down); a quiet
    stream whose member answers them stays as it is."""
    posts: list[float] = []
    server = LocalHttp(_stream([b'{"result":{"header":{},"created":true}}\n'], posts))
    events, stop = [], threading.Event()
    c = Etcd([server.url])
    t = threading.Thread(target=c.watch, args=("a", "b", lambda: events.append(1), stop))
    try:
        t.start()
        wait_until(lambda: events and c._streams, what="the stream made")
        (conn,) = c._streams
        sock = conn.sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert {name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
                for name in etcd.WATCH_KEEPALIVE} == {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5,
                                                      "TCP_KEEPCNT": 3}
        time.sleep(0.5)
        assert len(posts) == 1 and events == [1]  # quiet, and left alone
    finally:
        stop.set()
        c.close()
        t.join(timeout=scaled(5))
        server.close()
    assert not t.is_alive()


def test_urls_and_tls_files_are_checked_up_front(tmp_path):
    for bad in ("etcd:2379", "ftp://h:1", "http://h", "http://h:notaport"):
        with pytest.raises(UsageError, match="not an etcd client URL"):
            Etcd([bad])
    with pytest.raises(UsageError, match="no etcd URL"):
        Etcd([])
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate")
    with pytest.raises(UsageError, match="cannot use the etcd TLS files"):
        Etcd(["https://127.0.0.1:2379"], ca_cert=junk)
