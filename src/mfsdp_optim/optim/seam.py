"""What the repository's tools (``benchmarks/``, ``scripts/``) use from inside the wrapper
layer: not public API, changed with any commit that needs to.

The tools import no private module (``tests/infra/test_structure.py``, rule 5) and read no
private field of the package's objects (rule 2); what they need comes from here:

- the classifier's parts (``scripts/conformance.py``): ``LAYOUTS``, ``load_class``,
  ``references``, ``trial`` and ``kind_of``;
- a wrapper's insides: ``engines_of`` (its engines: each one's ``triton`` step and its
  counters) and ``captured_step_of`` (its ``CapturedStep``, with the ``graph``'s counters);
- the captured step (``benchmarks/bench_replay.py``): ``CapturedStep`` (to subclass), its
  ``Inputs``, and ``use_captured_step`` to give a wrapper one over a stand-in runner;
- the address checks of the kernel tables: ``addresses``, ``same_addresses``,
  ``check_all_lists``, ``bulk_check_available`` (``_infra.device_table``);
- the Triton Adam step (``benchmarks/bench_triton_adam.py``): ``TritonAdam``,
  ``launch_tuning`` and ``set_launch_tuning``;
- the whole-param planner (``benchmarks/bench_muon.py`` prints each rank's Newton-Schulz work and
  exchange bytes from it alone): ``ParamMeta`` (one param as the planner sees it), ``plan_units``
  (every rank's metas -> the units: owner, members, receivers, pieces; the same on every rank),
  ``muon_splits`` (the bytes of Muon's two exchanges per peer), ``generic_traffic`` (the piece
  bytes of the generic path's), ``piece_numel`` (the elements of one rank's piece);
- ``batched_newton_schulz`` (``benchmarks/check_batched_ns.py``): torch's Newton-Schulz over a
  ``(batch, rows, columns)`` stack.
"""

from .._infra.device_table import (
    addresses,
    bulk_check_available,
    check_all_lists,
    same_addresses,
)
from ._captured._graph import Inputs
from ._captured._step import CapturedStep
from ._engines._triton_adam import TritonAdam, launch_tuning, set_launch_tuning
from ._kinds._classify import LAYOUTS, load_class, references, trial
from ._kinds._kind_of import kind_of
from ._optimizer import captured_step_of, engines_of, use_captured_step
from ._whole._muon import batched_newton_schulz
from ._whole._pieces import piece_numel
from ._whole._plan import ParamMeta, generic_traffic, muon_splits, plan_units

__all__ = [
    "LAYOUTS",
    "CapturedStep",
    "Inputs",
    "ParamMeta",
    "TritonAdam",
    "addresses",
    "batched_newton_schulz",
    "bulk_check_available",
    "captured_step_of",
    "check_all_lists",
    "engines_of",
    "generic_traffic",
    "kind_of",
    "launch_tuning",
    "load_class",
    "muon_splits",
    "piece_numel",
    "plan_units",
    "references",
    "same_addresses",
    "set_launch_tuning",
    "trial",
    "use_captured_step",
]
