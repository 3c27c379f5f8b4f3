"""A node's ``[fleet] address`` as CRIU needs it: an address, not a name; a name that does not
resolve refuses the node at start instead of failing a migration late."""

from __future__ import annotations

import pytest

from ckpt_controller.errors import ConfigError
from support.cli import ckptctl


def test_a_host_name_resolves_to_the_address_criu_needs():
    """CRIU's page server takes an address, not a name (``Invalid server address``): the
    fleet's address is resolved, an IP address stays as it is, and a name that does not
    resolve is a ``ConfigError`` saying to give the IP address."""
    from ckpt_controller.endpoints import resolve_host

    assert resolve_host("localhost") in ("127.0.0.1", "::1")
    assert resolve_host("10.0.0.5") == "10.0.0.5" and resolve_host("[::1]") == "::1"
    with pytest.raises(ConfigError, match="does not resolve to an address") as info:
        resolve_host("no-such-node.invalid")
    assert info.value.details["key"] == "fleet.address" and info.value.exit_code == 2


def _serve_node_at(tmp_path, address: str):
    """``ckptctl serve`` of a node whose ``[fleet] address`` is ``address`` (its etcd
    nowhere: the address is judged first)."""
    (tmp_path / "hooks").mkdir()
    config = tmp_path / "node.toml"
    config.write_text(f'[controller]\nendpoint = "ipc://{tmp_path}/c.sock"\n'
                      f'state_dir = "{tmp_path}/state"\nhooks_dir = "{tmp_path}/hooks"\n'
                      '[fleet]\netcd = ["http://127.0.0.1:1"]\nnode = "n1"\n'
                      f'address = "{address}"\n')
    return ckptctl("serve", "--config", str(config), timeout=60)


def test_a_node_whose_address_does_not_resolve_is_refused_at_start(tmp_path):
    """``[fleet] address`` (the host's name when not given) must resolve: a node whose name
    does not is refused at start, exit 2, before it registers (a migration to it once failed
    late with ``criu page-server did not start on vm:PORT``)."""
    out = _serve_node_at(tmp_path, "no-such-node.invalid")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'no-such-node.invalid' does not resolve to an address" in out.stderr


def test_a_node_whose_address_is_not_its_own_is_refused_at_start(tmp_path):
    """A ``[fleet] address`` that is no address of this host (or of its network namespace)
    cannot be listened on by the target's page server: the node is refused at start, exit
    2, instead of failing a migration to it after the whole send."""
    from ckpt_controller.endpoints import check_local_address

    check_local_address("localhost", "127.0.0.1")
    with pytest.raises(ConfigError, match="not an address of this host"):
        check_local_address("node-b", "192.0.2.1")  # TEST-NET-1: never a host's own
    out = _serve_node_at(tmp_path, "192.0.2.1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'192.0.2.1' (192.0.2.1) is not an address of this host" in out.stderr
