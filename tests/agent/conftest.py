"""Agent tests: the agent in this process and inside a real step engine process, its drain
policy on a manual clock, and its failpoints.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
