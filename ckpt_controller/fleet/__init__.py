"""The fleet layer: node controllers coordinated through etcd (docs/fleet.md).

One controller per node stays the unit that captures; this package sits above it, and the
process that serves a node with ``[fleet]`` is composed above both (``ckpt_controller.serve``):
nothing in ``controller/`` imports this package, and a controller without ``[fleet]`` loads
none of it.

Modules, lowest first (each imports only those before it):

    etcd          the client: several members, TLS, watches, every failure one typed error
    keys          where everything lives in etcd (the key layout)
    records       what is stored there (typed with ``vocab``), and the one way to read it
    unavailable   the engines out of service fleet-wide: what ``--max-unavailable`` counts
    ops           fleet operations as etcd holds them: read, repeated ids, part ids
    kinds         the table of fleet kinds: limit rule, driver, CLI options, help
    local         a node-local operation run by the fleet, waited for
    parts         the per-engine parts driver: submit, the coordinator's side, a node's side
    migration/    the migration driver: its record, the coordinator's side, a node's steps
    drivers       each driver of the table, mapped to its code
    coordinator   drives every running fleet operation, on the elected node
    node          a node's registration, its engines' records, its inbox, the election
    guard         the controller's outside holder of engines on a node with ``[fleet]``
    registry      the fleet as readers see it; ``Resolver`` for clients that follow an engine
"""
