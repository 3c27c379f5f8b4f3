"""The core's tests: the lifecycle table, the wire protocol and the values it carries, the hub,
first contact with a missing or refusing peer, CURVE security, private directories, fuzzed
and overloaded live endpoints, and systemd notifications.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
