"""The tests' own support code: one home for what more than one test module uses.

Importable as ``support`` (pytest puts ``tests/`` on ``sys.path`` through the root
``conftest.py``). Each module has one subject:

- ``processes``: the engine, reference-engine and controller child processes a test starts,
  and ending them (``stop_all``, ``kill_naming``)
- ``cli``: ``ckptctl`` as a child process (``ckptctl(...)``, ``CKPTCTL``) and a child's
  streamed output (``StreamedLines``)
- ``config``: controller TOML: ``[[engine]]`` tables and the fleet table
- ``hooks``: hooks written into a controller's hooks folder, or linked to the shipped ones
- ``net``: who holds which ipc connection (free TCP ports: ``ckpt_controller.endpoints``)
- ``timing``: readiness waits (``wait_until``)
- ``zygote``: engines forked from a process that imported torch already (``make test``)
- ``criu``, ``etcd_cluster``, ``netns_util``, ``prometheus_server``, ``vllm``: the real parts
  beyond the venv, and why a test cannot use one here

Neighbours: ``tests/conftest.py`` and each folder's ``conftest.py`` hold only fixtures and
pytest hooks, built from these modules.
"""

from __future__ import annotations

from pathlib import Path

#: the checkout's root: the folder that holds ``ckpt_controller/``, ``hooks/`` and ``tests/``
ROOT = Path(__file__).resolve().parents[2]
