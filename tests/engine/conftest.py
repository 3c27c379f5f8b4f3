"""Reference engine tests: the model's cache paths, ``ckptctl engine serve`` processes under
load and overload, and clients that follow an engine (through etcd's registry too).

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
