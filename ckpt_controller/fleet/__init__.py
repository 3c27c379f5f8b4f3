"""The fleet layer: node controllers coordinated through etcd (docs/fleet.md).

One controller per node stays the unit that captures; this package sits above it. A node
controller with ``[fleet]`` in its TOML registers its node in etcd under a lease it keeps
alive and publishes its engines (``node.FleetNode``); ``ckptctl fleet`` reads and drives the
fleet through the same keys (``registry``). A controller without ``[fleet]`` imports nothing
of this package, and nothing below ``controller/`` knows etcd exists.

Modules: ``etcd`` (the client: several members, TLS, every failure one typed error),
``keys`` (the key layout and the records stored there), ``node`` (a node's registration and
publishing), ``registry`` (the fleet as the CLI reads it).
"""
