"""A stand-in for a vLLM server (not vLLM): the dev-mode endpoints the sidecar drives, with
vLLM 0.32's behaviours (a request sent while paused waits for ``/resume``; ``is_sleeping`` is
true while merely paused; a full ``wake_up`` resumes), ``/metrics``, and completions that
take ``--gen-s`` seconds (or the request's own ``standin_gen_s``: one long request beside short
ones) and answer a text derived from the prompt. Standard library only, one
process, so CRIU can capture and restore it where a real vLLM cannot run. Prints one JSON ready
line (``url``, ``pid``), then serves until killed.

Usage: python standin_server.py [--gen-s S] [--host HOST] [--port PORT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.paused = False
        self.asleep: set[str] = set()
        self.running = self.waiting = self.done = 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen-s", type=float, default=0.3)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    st = State()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:
            pass

        def _json(self, body: object, code: int = 200) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/health":
                self._json({})
            elif path == "/v1/models":
                self._json({"data": [{"id": "standin"}]})
            elif path == "/is_paused":
                self._json({"is_paused": st.paused})
            elif path == "/is_sleeping":
                self._json({"is_sleeping": st.paused or bool(st.asleep)})
            elif path == "/metrics":
                text = (f'vllm:num_requests_running{{engine="0"}} {st.running}\n'
                        f'vllm:num_requests_waiting{{engine="0"}} {st.waiting}\n'
                        f'vllm:request_success_total{{engine="0",finished_reason="length"}} '
                        f'{st.done}\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            else:
                self._json({"detail": "Not Found"}, 404)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            with st.lock:
                if url.path == "/pause":
                    st.paused = True
                    if query.get("mode") == ["wait"]:
                        st.lock.wait_for(lambda: st.running == 0)
                    self._json({"status": "paused"})
                elif url.path == "/resume":
                    st.paused = False
                    st.lock.notify_all()
                    self._json({"status": "resumed"})
                elif url.path == "/sleep":
                    st.paused, st.asleep = True, {"weights", "kv_cache"}
                    self._json({"status": "sleeping"})
                elif url.path == "/wake_up":
                    st.asleep -= set(query.get("tags") or st.asleep)
                    if not st.asleep:
                        st.paused = False
                        st.lock.notify_all()
                    self._json({"status": "sleeping" if st.asleep else "awake"})
                elif url.path == "/collective_rpc":
                    self._json({"results": [None]})
                elif url.path != "/v1/completions":
                    self._json({"detail": "Not Found"}, 404)
            if url.path == "/v1/completions":
                self._complete(json.loads(body or b"{}"))

        def _complete(self, req: dict) -> None:
            with st.lock:
                st.waiting += 1
                st.lock.wait_for(lambda: not st.paused)  # held while paused, as vLLM 0.32
                st.waiting -= 1
                st.running += 1
            time.sleep(float(req.get("standin_gen_s", args.gen_s)))
            text = hashlib.sha256(str(req.get("prompt")).encode()).hexdigest()[:16]
            with st.lock:
                st.running -= 1
                st.done += 1
                st.lock.notify_all()
            self._json({"choices": [{"text": text, "finish_reason": "length"}]})

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(json.dumps({"event": "ready", "url": f"http://127.0.0.1:{server.server_address[1]}",
                      "pid": os.getpid()}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
