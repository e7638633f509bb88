"""One base optimizer's step machinery: the ``Engine`` and every cache it keeps.

Map: ``_engine`` the ``Engine`` (one per base optimizer: its caches, prepare, step, skip);
``_route`` the one place choosing how its step runs (the fast step, the whole-param step or
the optimizer's own ``step()``); ``_slots`` the table of its params; ``_preparer`` the grads
of one step (work grads, casts, stats buckets; the recorded plan a steady step replays);
``_fast_step`` the direct Adam/AdamW step on lists of local shards and ``_triton_adam`` its
Triton kernel; ``_base_step`` the optimizer's own ``step()`` on the local-shard view of
``_views``. The whole-param step is ``optim/_whole``. Import the leaf modules (this file
imports none of them).
"""
