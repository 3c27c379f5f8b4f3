"""Migration: an engine moves from its node controller (the source) to another (the target)
with CRIU, and at every moment exactly one node owns it (``ckptctl fleet migrate``).

A migration is a fleet operation of kind ``migrate`` (``Drive.STEPS`` in ``fleet.kinds``) with
one record of its own, ``migrations/<op>`` (``records.Migration``). The elected coordinator
(``driver``) drives it through steps, one at a time, each a ``Task`` in one node's inbox; the
node (``steps``) runs it and writes its end into ``migration-steps/<op>/<step>``
(``records.StepEnd``) in the transaction that takes it out of its inbox. Every step is
idempotent: its node-local operations have ids made from the fleet operation's
(``record.local_ids``), so a step tried again finds their first result in the node's journal.

=========  ======  ===========================================================================
step       node    what it does
=========  ======  ===========================================================================
receive    target  at a level that may be 2, the digests of the files the engine re-wakes
                   from (``weights``; one it cannot read fails it); the image folder;
                   ``page-server``: a ``criu page-server`` there
send       source  at level 2, the target's digests against its own (a difference fails it
                   before anything is done); a node-local prepare, then a capture whose dump
                   hooks dump with
                   ``CKPT_CRIU_MODE=leave-stopped`` (the dumped tree stays, stopped), into the
                   target's page server or the shared folder; the small image files through etcd
adopt      target  the image checked, the engine adopted (journaled), a node-local restore
                   (criu restore beside the stopped original, re-wake, bit-exact weights, golden
                   prompt); between re-wake and re-admission the target takes ``owners/<engine>``
                   in one transaction that needs ``moving/<engine>`` to still name this
                   migration, and publishes the engine's record (again once it runs)
finish     source  the stopped tree killed; the engine given away (journaled)
resume     source  (instead of finish, when the target did not take it) SIGCONT, and a
                   node-local restore: RUNNING on the source again
abandon    target  (after a failed send) the page server stopped, the folder removed
=========  ======  ===========================================================================

The coordinator resumes the source only after a transaction that deletes ``moving/<engine>``
while it still names this migration: from then on the target cannot take the engine, and
before it the source's copy is stopped. So the engine is RUNNING on at most one node, and when
a step fails or its node dies, on exactly one once the nodes are back (``docs/fleet.md`` has
the table of failure points and their outcomes).

Modules, by who runs them: ``record`` (the record, its submit and a step's end: shared),
``driver`` (the coordinator's), ``steps`` (a node's: each step), ``settle`` (a node's: what a
migration that ended while the node was away left there), ``procs`` (the dumped process
tree: stopped, continued, ended), ``weights`` (the files a level-2 re-wake reads, checked on
both nodes).
"""
