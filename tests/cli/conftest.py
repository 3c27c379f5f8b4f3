"""Command-line tests: ``ckptctl`` as people and scripts run it: help and exit codes, progress,
status tables, completion, every ``--json`` document against docs/json.md, the systemd units
and log setup.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
