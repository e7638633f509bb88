"""Integrations: the wrapper inside the trainers FSDP2 users run (docs/trainers.md).

Map: ``lightning`` the Lightning Trainer callback and the Fabric helpers; ``torchtitan`` the
optimizers container and the trainer that lets the wrapper clip once (``_torchtitan_trainer``,
apart from the container since it imports torchtitan's trainer); ``accelerate`` the order
of ``fully_shard``, wrapping and ``prepare()`` that works, and the norm behind accelerate's
optimizer; ``_lazy`` each module's lazy import of its framework. Each public module imports
without its framework and raises an ``ImportError`` that names what to install on first use;
the implementation lives in the ``_``-prefixed module beside it. Layers it may import:
``optim``, ``stats``, ``checkpoint`` (their public names only: ``tests/infra/test_layers.py``).
"""
