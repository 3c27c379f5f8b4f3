"""Benchmark tests: every script in bench/ run at small sizes, each table's inputs checked as
measured (never the figures).

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
