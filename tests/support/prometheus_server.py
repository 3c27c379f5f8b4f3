"""A real Prometheus for the tests (``make prometheus``): one process on a free loopback port
with its own storage folder, scraping the targets it is given every second and evaluating the
shipped alert rules (deploy/prometheus/), and a client for its HTTP API (``/api/v1/...``).

The binaries come from ``.cache/prometheus/bin``; ``prometheus_tool`` finds them or skips the
test saying so (a failure under ``CKPT_REQUIRE_PARTS=1``). Neighbours: ``test_prometheus`` (a
controller) and ``test_vllm_adapter`` (a controller and a vLLM server side by side).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ckpt_controller.endpoints import free_port
from support import ROOT
from support.timing import deadline_in

BIN = ROOT / ".cache" / "prometheus" / "bin"
RULES = ROOT / "deploy" / "prometheus" / "ckpt-controller.rules.yml"


def prometheus_tool(name: str) -> Path:
    """``make prometheus``'s ``prometheus`` or ``promtool`` (``.cache/prometheus/bin``); skips
    the calling test with the reason when it is not installed."""
    path = BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"{name} is not installed: run `make prometheus`")
    return path


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a GET, never through a proxy; a 4xx/5xx is returned, not raised."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:  # policy: an error status is an answer like any other
        with err:
            return err.code, err.read()


class Prometheus:
    """``prometheus`` scraping ``jobs`` ({job name: ["host:port", ...]}) every second, with
    the shipped rules loaded; storage and log in ``folder``. ``stop()`` ends it."""

    def __init__(self, folder: Path, jobs: dict[str, list[str]], timeout_s: float = 60.0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        # JSON is YAML: written with json, no YAML library needed
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in jobs.items()]}))
        self.log_path = folder / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = deadline_in(timeout_s)
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-3000:]}")
            try:
                if http_get(self.url + "/-/ready", timeout_s=2)[0] == 200:
                    return
            except OSError:  # policy: not listening yet: try again until the deadline
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready in {timeout_s} s: "
                                   f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def api(self, path: str, **params: str):
        """``GET /api/v1/<path>?params``: its ``data``; an error answer is an AssertionError
        naming the query and Prometheus's error."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", (path, params, reply)
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
