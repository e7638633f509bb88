"""Whole-param optimizer steps on sharded DTensor params (Muon, Adafactor, unknown classes).

Map:
_step.py     step_whole_params: the entry point (validation, plan cache, recipe choice)
_checks.py   what torch's Muon and Adafactor would reject, checked before the step
_plan.py     metas -> units (shard groups, receivers, pieces) and owners (LPT); byte counts
_pieces.py   which elements each mesh coordinate holds; extract/insert pieces of full tensors
_exchange.py counted all-to-alls of byte messages, a status word per message
_verdict.py  host_sync=False: the step's verdict kept on the device (Muon)
_muon.py     Muon: elementwise parts on shards, Newton-Schulz on owners
_ns_probe.py whether batched Newton-Schulz is torch's bits, proven once per kind of batch
_generic.py  any class: its own step() on full tensors on owners

The try / exchange / settle of every step is ``_infra.attempt.Attempt``. The wrapper
(``optim``) uses the names below; the benchmarks reach the planner through
``optim/seam.py``; tests import the private modules.
"""

from ._step import recipe_for, step_whole_params
from ._verdict import DeviceVerdict

__all__ = ["DeviceVerdict", "recipe_for", "step_whole_params"]
