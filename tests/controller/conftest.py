"""Controller tests: ``ckptctl serve`` and the in-process ``ControllerServer`` with real
engines and agents: operations, links, images, preflight, the roster, config, journal,
metrics (and a real Prometheus), the hook table and runner, crash recovery, start-up.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
