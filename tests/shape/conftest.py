"""The package's shape, read from its source: layers and import cycles, module sizes, one
vocabulary, and what ``ckptctl --help`` and ``import ckpt_controller`` load.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
