"""The project's version (``ckptctl --version``, a node's record in etcd). Imports nothing."""

__version__ = "0.1.0"
