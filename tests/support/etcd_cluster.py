"""Real etcd members for the fleet tests: one, or a cluster of three, each a process on its own
loopback ports with its own data folder; members can be stopped and started again. A member
may also answer clients on other addresses of this host (``hosts``: say the root side of a
veth pair that a network namespace reaches it through); its peers stay on loopback.

The binaries come from ``make etcd`` (``.cache/etcd/bin``); ``installed()`` says whether they
are there, and the ``etcd`` fixture (``tests/conftest.py``) skips with the reason when they
are not (CI: a failure, ``CKPT_REQUIRE_PARTS``). ``tls=True`` makes a CA, a server certificate for
127.0.0.1 and a client certificate with ``openssl``, and has every member require client
certificates signed by that CA (the server certificate names every address in ``hosts``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ckpt_controller.endpoints import free_port
from support import ROOT
from support.timing import deadline_in

ETCD = ROOT / ".cache" / "etcd" / "bin" / "etcd"


def installed() -> bool:
    return ETCD.is_file() and os.access(ETCD, os.X_OK)


class Certs:
    """A CA, a server certificate (127.0.0.1, localhost and ``ips``) and a client certificate,
    made with openssl in ``d``."""

    def __init__(self, d: Path, ips: Sequence[str] = ()) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.ca, self.ca_key = d / "ca.pem", d / "ca-key.pem"
        self.server, self.server_key = d / "server.pem", d / "server-key.pem"
        self.client, self.client_key = d / "client.pem", d / "client-key.pem"
        self.other_ca = d / "other-ca.pem"  # a CA that signed nothing here
        run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", str(self.ca_key), "-out", str(self.ca))
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=other",
            "-keyout", str(d / "other-key.pem"), "-out", str(self.other_ca))
        for name, cert, key, ext in (
                ("server", self.server, self.server_key,
                 "subjectAltName=" + ",".join(f"IP:{ip}" for ip in ("127.0.0.1", *ips))
                 + ",DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth"),
                ("client", self.client, self.client_key, "extendedKeyUsage=clientAuth")):
            csr, extfile = d / f"{name}.csr", d / f"{name}.ext"
            extfile.write_text(ext + "\n")
            run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", str(key), "-out", str(csr))
            run("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                "-CAcreateserial", "-days", "2", "-extfile", str(extfile), "-out", str(cert))


class EtcdCluster:
    """``size`` etcd members on loopback, started at once; ``urls`` are their client URLs.
    ``hosts``: the addresses every member answers clients on, each on the member's one client
    port (``urls_on(host)``); ``urls`` are those on the first."""

    def __init__(self, d: Path, size: int = 1, tls: bool = False,
                 hosts: Sequence[str] = ("127.0.0.1",)) -> None:
        self.d = d
        d.mkdir(parents=True, exist_ok=True)
        self.size = size
        self.hosts = tuple(hosts)
        self.certs = Certs(d / "certs", ips=self.hosts) if tls else None
        self.scheme = "https" if tls else "http"
        self.names = [f"m{i}" for i in range(size)]
        self.client_ports = [free_port() for _ in range(size)]
        self.peer_ports = [free_port() for _ in range(size)]
        self.urls = self.urls_on(self.hosts[0])
        self.procs: list[subprocess.Popen | None] = [None] * size
        self._initial = ",".join(f"{n}=http://127.0.0.1:{p}"
                                 for n, p in zip(self.names, self.peer_ports))
        try:
            for i in range(size):
                self.start(i, new=True)
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    def urls_on(self, host: str) -> list[str]:
        """The members' client URLs on ``host`` (one of ``hosts``)."""
        assert host in self.hosts, host
        return [f"{self.scheme}://{host}:{p}" for p in self.client_ports]

    def start(self, i: int, new: bool = False) -> None:
        """Start member ``i`` (again: it rejoins with its data folder)."""
        assert self.procs[i] is None or self.procs[i].poll() is not None
        client_urls = ",".join(self.urls_on(host)[i] for host in self.hosts)
        args = [str(ETCD), "--name", self.names[i], "--data-dir", str(self.d / self.names[i]),
                "--listen-client-urls", client_urls, "--advertise-client-urls", client_urls,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", self._initial, "--initial-cluster-token", "ckpt-test",
                "--initial-cluster-state", "new",
                # quick elections: members on one loaded machine, tests that stop them
                "--heartbeat-interval", "100", "--election-timeout", "1000"]
        if self.certs is not None:
            c = self.certs
            args += ["--cert-file", str(c.server), "--key-file", str(c.server_key),
                     "--client-cert-auth", "--trusted-ca-file", str(c.ca)]
        log = open(self.d / f"{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()

    def stop(self, i: int, kill: bool = False) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return
        proc.kill() if kill else proc.terminate()
        proc.wait(timeout=10)

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def client(self, **kw):
        from ckpt_controller.fleet.etcd import Etcd

        if self.certs is not None:
            kw.setdefault("ca_cert", self.certs.ca)
            kw.setdefault("cert", self.certs.client)
            kw.setdefault("key", self.certs.client_key)
        return Etcd(self.urls, **kw)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until a write through the running members succeeds (there is a leader)."""
        from ckpt_controller.errors import CkptError

        deadline = deadline_in(timeout_s)
        with self.client(timeout_s=1.0) as c:
            while True:
                try:
                    c.put("/health-of-test-cluster", "ok")
                    return
                except CkptError:
                    dead = [i for i, p in enumerate(self.procs) if p and p.poll() is not None]
                    if time.monotonic() > deadline or len(dead) == self.size:
                        logs = {n: (self.d / f"{n}.log").read_text()[-2000:]
                                for n in self.names}
                        raise RuntimeError(f"etcd did not become healthy: {logs}")
                    time.sleep(0.1)

    def toml(self, host: str | None = None) -> str:
        """The ``etcd`` and TLS keys of a ``[fleet]`` table for this cluster (its URLs on
        ``host``, default the first of ``hosts``)."""
        urls = self.urls if host is None else self.urls_on(host)
        out = "etcd = [" + ", ".join(f'"{u}"' for u in urls) + "]\n"
        if self.certs is not None:
            c = self.certs
            out += f'ca_cert = "{c.ca}"\ncert = "{c.client}"\nkey = "{c.client_key}"\n'
        return out

    def close(self) -> None:
        for i in range(self.size):
            try:
                self.stop(i, kill=True)
            except subprocess.TimeoutExpired:
                pass
