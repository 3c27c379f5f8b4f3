"""Fleet tests (``-m fleet``): node controllers in real etcd members, migration between two
nodes in network namespaces with real CRIU, the coordinator's decisions, and moving a real
vLLM (``-m 'vllm and fleet'``).

No fixture here is shared by two of this folder's modules yet; the suite's own fixtures are in
``tests/conftest.py``. A fixture only this folder's tests use goes here.
Neighbours: ``tests/conftest.py``, the ``support`` package.
"""
