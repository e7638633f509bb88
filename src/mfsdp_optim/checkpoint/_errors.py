"""The checkpoint layer's errors, in one place (each also exported by ``mfsdp_optim.checkpoint``,
``mfsdp_optim.errors`` and ``mfsdp_optim``). Which input raises which: docs/errors.md."""

from __future__ import annotations

import pickle

from .._infra.agreement import RankMismatchError

__all__ = [
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "KeyspaceError",
    "RankDisagreementError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
]


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint's save never finished (a rank died, or it is still being written)."""


class CorruptCheckpointError(ValueError):
    """The checkpoint is complete but its files are damaged, missing or from another save."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked the unpickler for something outside the allow-list."""


class StateDictMismatchError(ValueError):
    """The state dict does not fit the live optimizer; raised on every rank, nothing changed."""


class KeyspaceError(ValueError):
    """The ranks' optimizer states cannot be described consistently; raised on every rank."""


class RankDisagreementError(RankMismatchError):
    """Ranks called a checkpoint collective with different state dicts; raised on every rank."""
