"""Network namespaces for the multi-host tests, made and removed by the test that uses them:
``Namespaces`` makes namespaces (named per run: parallel runs do not collide), joins them to
each other or to the root namespace with veth pairs on link-local 169.254.77.x addresses, and
``remove()`` takes everything away again (the processes left inside, the links, the
namespaces), also after a test that failed. Needs root and iproute2; ``Namespaces.or_skip``
says why it cannot run where it cannot. Neighbours: ``test_netns`` (a controller and an engine
apart), ``test_fleet_netns`` (node controllers apart, etcd in the root namespace).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess

import pytest

#: the link-local block the tests' veth pairs take their addresses from
BLOCK = ipaddress.ip_network("169.254.77.0/24")
#: held while /30s in the root namespace are chosen and assigned (parallel runs on one host)
_ROOT_LOCK = "/tmp/ckpt-netns-root.lock"


def ip(*args: str) -> str:
    """``ip ARGS``; its stdout (``CalledProcessError`` with its stderr when it fails)."""
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def run_tag() -> str:
    """A short tag unique to this test process, for namespace and interface names (an
    interface name has at most 15 characters)."""
    return f"{os.getpid() % 100000}"


class Namespaces:
    """The namespaces and links one test made; ``remove()`` takes them all away."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.root_links: list[str] = []

    @classmethod
    def or_skip(cls, first: str) -> "Namespaces":
        """A ``Namespaces`` holding namespace ``first``, or a skip saying why none can be made
        here (not root, no ``ip``, a kernel or container that refuses)."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("network namespaces need root and iproute2 (ip)")
        made = cls()
        try:
            made.add(first)
        except subprocess.CalledProcessError as err:  # policy: no namespaces here: say why
            pytest.skip(f"cannot make a network namespace here: {err.stderr.strip()}")
        return made

    def add(self, name: str) -> str:
        ip("netns", "add", name)
        self.names.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def join(self, ns_a: str, if_a: str, addr_a: str, ns_b: str, if_b: str, addr_b: str,
             prefix: int = 24) -> None:
        """A veth pair between two of these namespaces, each end addressed and up."""
        ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
        for ns, ifname, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
            ip("link", "set", ifname, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", ifname)
            ip("-n", ns, "link", "set", ifname, "up")

    def join_root(self, ns: str, root_if: str, ns_if: str) -> tuple[str, str]:
        """A veth pair from the root namespace to ``ns``, on a /30 of ``BLOCK`` that no
        address of the root namespace is in yet; (the root side's address, ``ns``'s)."""
        with open(_ROOT_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            taken = {ipaddress.ip_interface(word).ip for line in
                     ip("-4", "-o", "addr", "show").splitlines()
                     for word in line.split()[3:4]}
            subnets = list(BLOCK.subnets(new_prefix=30))
            start = os.getpid() % len(subnets)
            free = next((net for net in subnets[start:] + subnets[:start]
                         if not any(addr in net for addr in taken)), None)
            assert free is not None, f"every /30 of {BLOCK} is in use in the root namespace"
            root_addr, ns_addr = (str(host) for host in free.hosts())
            ip("link", "add", root_if, "type", "veth", "peer", "name", ns_if)
            self.root_links.append(root_if)
            ip("link", "set", ns_if, "netns", ns)
            ip("addr", "add", f"{root_addr}/30", "dev", root_if)
            ip("link", "set", root_if, "up")
        ip("-n", ns, "addr", "add", f"{ns_addr}/30", "dev", ns_if)
        ip("-n", ns, "link", "set", ns_if, "up")
        return root_addr, ns_addr

    def segment(self, switch: str, members: dict[str, str], root_if: str | None = None,
                prefix: int = 28) -> dict[str, str]:
        """One link-local segment joining ``members`` (namespace -> its end's interface
        name) and, with ``root_if``, the root namespace: a bridge in namespace ``switch``
        (made here) with a veth pair to each, all on one free /``prefix`` of ``BLOCK``, so
        every member reaches every other one (a node's page server, its engines) and the
        root namespace reaches them all. Returns each member's address (the root's under
        ``"root"``)."""
        self.add(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        with open(_ROOT_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            taken = {ipaddress.ip_interface(word).ip for line in
                     ip("-4", "-o", "addr", "show").splitlines()
                     for word in line.split()[3:4]}
            subnets = list(BLOCK.subnets(new_prefix=prefix))
            start = os.getpid() % len(subnets)
            free = next((net for net in subnets[start:] + subnets[:start]
                         if not any(addr in net for addr in taken)), None)
            assert free is not None, f"every /{prefix} of {BLOCK} is in use"
            hosts = iter(str(h) for h in free.hosts())
            addresses = {}
            ends = list(members.items()) + ([("root", root_if)] if root_if else [])
            for i, (ns, ifname) in enumerate(ends):
                peer = f"{ifname[:12]}s{i}"
                ip("link", "add", ifname, "type", "veth", "peer", "name", peer)
                ip("link", "set", peer, "netns", switch)
                ip("-n", switch, "link", "set", peer, "master", "br0")
                ip("-n", switch, "link", "set", peer, "up")
                addr = addresses[ns] = next(hosts)
                if ns == "root":
                    self.root_links.append(ifname)
                    ip("addr", "add", f"{addr}/{prefix}", "dev", ifname)
                    ip("link", "set", ifname, "up")
                else:
                    ip("link", "set", ifname, "netns", ns)
                    ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", ifname)
                    ip("-n", ns, "link", "set", ifname, "up")
        return addresses

    def enter(self, ns: str) -> list[str]:
        """The command prefix that runs a command in ``ns``'s network namespace only (the
        host's mount namespace stays: CRIU, run by a process there, needs it; ``ip netns
        exec`` makes a mount namespace of its own)."""
        return ["nsenter", f"--net=/run/netns/{ns}"]

    def exec_in(self, ns: str) -> list[str]:
        """The command prefix that runs a command in ``ns`` (``ip netns exec`` execs it: the
        child's PID is the command's own)."""
        return ["ip", "netns", "exec", ns]

    def remove(self) -> None:
        """Kill what still runs in these namespaces (only this test's processes can be
        there), then delete the root sides of the links and the namespaces; a namespace's
        end of a link goes with it. Whatever is already gone is skipped."""
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:  # policy: it ended meanwhile: nothing to end
                    continue
        for link in self.root_links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
