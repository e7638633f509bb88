"""The wrapper's captured step (``OptimizerConfig(cuda_graph=True)``): a CUDA graph of
``step()``, replayed while nothing it reads changed.

Map: ``_step`` ``CapturedStep``, ``step()`` in that mode (what a capture reads, which steps can
be captured, the host-side effects of a replay); ``_graph`` its pure bookkeeping (the inputs a
capture depends on, the per-step decision to replay, capture again or run eagerly, the device
slots of the lr and the counters). Import the leaf modules (this file imports none of them).
"""
