"""Memory tests: release levels, tags, budgets and checksums on real torch tensors (CPU, and
CUDA where there is a GPU), the fill and the safetensors writer.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
