"""Shared infrastructure beneath the three layers (stats, wrapper, checkpoint).

Map: ``placement`` facts read from DTensor specs; ``comm`` collective plumbing and host reads;
``agreement`` the one "validate, agree, then act" protocol; ``attempt`` a step of phases and
collectives that keeps a rank's failure, still enters every collective and raises on every
rank alike (built on ``agreement``); ``params`` how params are named and described; ``caches``
every module-level cache, dropped by one ``clear_all()``; ``group_lists`` lists kept beside
param groups; ``device_table`` and ``kernels`` the Triton kernels' argument tables and shared
device helpers; ``grouping`` tensors by ``(device, dtype)``; ``host`` the collector paused
around per-item Python loops. Layers it may import: none.
"""
