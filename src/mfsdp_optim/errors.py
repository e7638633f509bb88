"""Every public error class of mfsdp_optim, in one place (each also at the top level).

A program that catches the package's errors imports them from here (``from mfsdp_optim.errors
import HyperparameterMismatchError``) or from ``mfsdp_optim``. Each class is defined by the layer
that raises it, and its layer still exports it under the same name, so ``mfsdp_optim.stats
.RankFailedError`` is ``mfsdp_optim.errors.RankFailedError``. The checkpoint layer's errors load
that layer (and ``torch.distributed.checkpoint``) on first access. Which input raises which
error, with its message: the documentation's "Errors" page.

Raised on every rank of a group alike (so no rank is left waiting):

- ``RankFailedError`` (a ``RuntimeError``): on the healthy ranks, when another rank's input
  was refused (that rank raises its own error).
- ``RankMismatchError`` (a ``ValueError``): ranks passed values that must be equal; the base of
  ``StatsArgumentMismatchError`` (``norm_type``, ``count_zeros``),
  ``HyperparameterMismatchError`` (param-group values) and ``RankDisagreementError``
  (checkpoints).
- ``GradPresenceError`` (a ``ValueError``): a param's grad is None on some ranks of its mesh
  only.
- The checkpoint layer's: ``IncompleteCheckpointError``, ``CorruptCheckpointError``,
  ``UnsafeCheckpointError``, ``StateDictMismatchError``, ``RankDisagreementError``,
  ``KeyspaceError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._infra.agreement import RankMismatchError
from .optim import HyperparameterMismatchError
from .stats import GradPresenceError, RankFailedError, StatsArgumentMismatchError

# the checkpoint layer's errors, imported with that layer when first asked for
CHECKPOINT_ERRORS = (
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "KeyspaceError",
    "RankDisagreementError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
)

__all__ = [
    "GradPresenceError",
    "HyperparameterMismatchError",
    "RankFailedError",
    "RankMismatchError",
    "StatsArgumentMismatchError",
    *CHECKPOINT_ERRORS,
]


def __getattr__(name: str) -> Any:
    if name in CHECKPOINT_ERRORS:
        return getattr(importlib.import_module(".checkpoint", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
