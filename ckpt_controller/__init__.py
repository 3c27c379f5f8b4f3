"""ckpt-controller: drives LLM inference engines through a checkpoint/restore lifecycle.

Layers, lowest first (``LAYERS``; a module imports only from its own layer and the ones
below it, with no import cycle, also through imports inside functions: tested):

    vocab         every state, trigger, mode, reason, level and status (imports nothing)
    errors        the error tree
    foundations   small helpers: units, clock, values, files, endpoints, processes, CURVE
                  keys, systemd's notify socket, CRIU images
    lifecycle     the one transition table, on ``transitions``
    protocol      wire messages (msgspec) and framing (pyzmq-free codec)
    transport     pyzmq sockets: the control loop, clients, first contact, the hub
    memory        torch tensors under tags: release, re-wake, verify (imports torch)
    agent         engine side: admission gate, drain, control endpoint
    engines       the reference engine (``engine``) and the vLLM adapter (``adapters``)
    controller    the node's service: operations, hooks, journal, metrics
    fleet, drill  node controllers through etcd (``fleet``); recovery drills (``drill``)
    serve         the ``ckptctl serve`` process: a controller and its part in the fleet
    cli           ``ckptctl``
    package       this module: names loaded on first use

Importing the package imports nothing else: ``ckptctl --help`` and a client stay light, and
the names below load on first use. Neighbours: ``vocab`` (``CheckpointState``),
``controller.client`` (``ControllerClient``, docs/client.md), ``cli``.
"""

from __future__ import annotations

__all__ = ["CheckpointState", "ControllerClient", "__version__"]

#: the layers, lowest first: (name, the modules and packages under ``ckpt_controller`` in it)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocab", ("vocab", "version")),
    ("errors", ("errors",)),
    ("foundations", ("units", "clock", "values", "files", "endpoints", "procutil", "security",
                     "sdnotify", "criu_images")),
    ("lifecycle", ("lifecycle",)),
    ("protocol", ("protocol",)),
    ("transport", ("zmqutil", "hub", "contact", "rpc", "rpcserver")),
    ("memory", ("memory",)),
    ("agent", ("agent",)),
    ("engines", ("engine", "adapters")),
    ("controller", ("controller",)),
    ("fleet, drill", ("fleet", "drill")),
    ("serve", ("serve",)),
    ("cli", ("cli", "__main__")),
    ("package", ("__init__",)),
)


def __getattr__(name: str):
    # PEP 562: ``ckpt_controller.CheckpointState`` loads the vocabulary only when someone
    # asks for it
    if name == "__version__":  # (its own module: the layers below read it from there)
        from ckpt_controller.version import __version__

        return __version__
    if name == "CheckpointState":
        from ckpt_controller.vocab import CheckpointState

        return CheckpointState
    if name == "ControllerClient":  # the transport (pyzmq) loads only for a client
        from ckpt_controller.controller.client import ControllerClient

        return ControllerClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
