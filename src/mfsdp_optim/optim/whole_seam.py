"""The whole-param planner and Newton-Schulz (``optim/_whole``), for the repository's tools.

``benchmarks/bench_muon.py`` prints each rank's Newton-Schulz work and exchange bytes from the
planner alone, and ``benchmarks/check_batched_ns.py`` compares the batched Newton-Schulz with
torch's per-matrix one; they reach ``optim/_whole`` through these names only (a tool imports
no private module: ``tests/infra/test_structure.py``, rule 5). Not the package's public API
(``docs/API.md``): the names follow the planner.

- ``ParamMeta``: one param as the planner sees it (name, global shape, dtype, mesh, placements);
- ``plan_units``: every rank's metas -> the units (owner, members, receivers, pieces), the same
  on every rank;
- ``muon_splits``: the bytes of Muon's two exchanges per peer; ``generic_traffic``: the piece
  bytes of the generic path's;
- ``piece_numel``: the elements of one rank's piece of a param;
- ``batched_newton_schulz``: torch's Newton-Schulz over a ``(batch, rows, columns)`` stack.
"""

from ._whole._muon import batched_newton_schulz
from ._whole._pieces import piece_numel
from ._whole._plan import ParamMeta, generic_traffic, muon_splits, plan_units

__all__ = [
    "ParamMeta",
    "batched_newton_schulz",
    "generic_traffic",
    "muon_splits",
    "piece_numel",
    "plan_units",
]
