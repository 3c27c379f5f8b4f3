"""Hook and CRIU tests: the shipped hooks (``hooks/``) against real CRIU, between two nodes in
network namespaces, and against recording stand-ins (``tests/standins``); a controller and
an engine in two network namespaces.

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
