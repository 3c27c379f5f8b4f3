"""Controller config text for tests: ``[[engine]]`` tables, the ``[defaults]`` table and a
node's ``[fleet]`` table, written the one way the tests write them.

A config a test starts a controller with is the text after the ``[controller]`` keys that
``processes.ControllerProcess`` writes itself. Neighbours: ``processes``,
``ckpt_controller.config`` (what reads it).
"""

from __future__ import annotations

from collections.abc import Mapping


def _name_and_control(engine) -> tuple[str, str]:
    """An engine process (``.control``), an in-process agent (``.endpoint``) or a
    ``(name, control)`` pair."""
    if isinstance(engine, tuple):
        return engine
    return engine.name, getattr(engine, "control", None) or engine.endpoint


def engine_table(engine, *, kind: str | None = None, labels: Mapping[str, str] | None = None,
                 extra: str = "") -> str:
    """One ``[[engine]]`` table: its name and control endpoint, ``kind`` and ``labels`` when
    given, then ``extra`` lines (keys of its own, or an ``[engine.defaults]`` table)."""
    name, control = _name_and_control(engine)
    text = f'[[engine]]\nname = "{name}"\ncontrol = "{control}"\n'
    if kind is not None:
        text += f'kind = "{kind}"\n'
    if labels:
        text += "labels = { " + ", ".join(f'{k} = "{v}"' for k, v in labels.items()) + " }\n"
    return text + (extra + "\n" if extra else "")


def engines_toml(*engines, defaults: str = "", kind: str | None = None,
                 labels: Mapping[str, str] | None = None, extra: str = "") -> str:
    """A ``[defaults]`` table of the lines ``defaults`` (when given), then an ``[[engine]]``
    table for each engine (``engine_table``; ``kind``, ``labels`` and ``extra`` for each)."""
    text = f"[defaults]\n{defaults}\n" if defaults else ""
    return text + "".join(engine_table(e, kind=kind, labels=labels, extra=extra)
                          for e in engines)


def fleet_toml(etcd_keys: str, node: str, *, ttl: int = 2, address: str | None = None,
               extra: str = "") -> str:
    """A node's ``[fleet]`` table: ``etcd_keys`` (``EtcdCluster.toml()``), the node's name,
    a lease of ``ttl`` seconds published every 0.2 s, its ``address`` when given, then
    ``extra`` lines."""
    text = (f'[fleet]\n{etcd_keys}node = "{node}"\nlease_ttl_s = {ttl}\n'
            "publish_interval_s = 0.2\n")
    if address is not None:
        text += f'address = "{address}"\n'
    return text + extra


def node_toml(cluster, node: str, engines=(), *, labels: Mapping[str, str] | None = None,
              ttl: int = 2, host: str | None = None, address: str | None = None,
              extra: str = "") -> str:
    """A fleet node's config: its ``[fleet]`` table in ``cluster`` (an ``EtcdCluster``, its
    URLs on ``host``; ``fleet_toml``'s ``ttl``, ``address`` and ``extra``), then an
    ``[[engine]]`` table for each of ``engines``, each with ``labels``."""
    return (fleet_toml(cluster.toml(host), node, ttl=ttl, address=address, extra=extra)
            + engines_toml(*engines, labels=labels))


def controller_toml(folder, *engines, keys: str = "", defaults: str = "") -> str:
    """A whole config for a controller in this process (``ControllerServer``): a
    ``[controller]`` table with its endpoint (``ipc://FOLDER/ctl.sock``), its state dir in
    ``folder`` and the lines ``keys``, then ``engines_toml(*engines, defaults=defaults)``."""
    return (f'[controller]\nendpoint = "ipc://{folder}/ctl.sock"\nstate_dir = "{folder}/state"\n'
            + keys + engines_toml(*engines, defaults=defaults))
