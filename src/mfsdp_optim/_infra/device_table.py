"""Persistent argument tables of the Triton kernels: built once, kept on the device, patched.

Map: ``DeviceTable`` an int64 host table (element offsets, numels, cumulative block counts)
mirrored on the device, re-uploaded slice by slice on the current stream; ``addresses`` and
``same_addresses`` the per-step check that a list's tensors still sit where the table says (a
C++ loop on CUDA builds of torch: ``bulk_check_available``); ``CHECK_ALL_ENV`` /
``check_all_lists`` check every list at every step. Used by ``stats._fused`` and
``optim._engines._triton_adam``. Precondition: whoever holds a table holds the tensors it
describes. Why nothing goes stale unseen: docs/concepts.md, "Kernel argument tables".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "CHECK_ALL_ENV",
    "DeviceTable",
    "addresses",
    "bulk_check_available",
    "check_all_lists",
    "same_addresses",
]

CHECK_ALL_ENV = "MFSDP_OPTIM_CHECK_ALL_ADDRESSES"

_bulk_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def bulk_check_available() -> bool:
    """Whether this torch build has the C++ loop ``same_addresses`` uses (else a Python one)."""
    return _bulk_check is not None


def check_all_lists() -> bool:
    """Whether every list (not only the grads) is checked at every step."""
    return os.environ.get(CHECK_ALL_ENV, "") not in ("", "0")


def addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The tensors' ``data_ptr()``s, in order."""
    return list(map(torch.Tensor.data_ptr, tensors))


def same_addresses(
    tensors: Sequence[torch.Tensor], ptrs: list[int], indices: list[int] | None = None
) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` in ``indices`` (default:
    all; then the lengths must match too). The one per-step check of the persistent tables."""
    if indices is None:
        if len(tensors) != len(ptrs):
            return False
        if _bulk_check is None:
            return addresses(tensors) == ptrs
        indices = _all_indices(len(ptrs))
    if _bulk_check is not None:
        return bool(
            _bulk_check(tensors if isinstance(tensors, list) else list(tensors), ptrs, indices)
        )
    data_ptr = torch.Tensor.data_ptr
    return all(data_ptr(tensors[i]) == ptrs[i] for i in indices)


def _all_indices(n: int) -> list[int]:
    """``list(range(n))``, kept per ``n`` (the bulk check's index list for a whole list: built
    once, not once per tensor and step). Read only: the C++ check does not keep or change it."""
    indices = _ALL_INDICES.get(n)
    if indices is None:
        if len(_ALL_INDICES) >= 64:
            _ALL_INDICES.clear()
        indices = _ALL_INDICES[n] = list(range(n))
    return indices


_ALL_INDICES: dict[int, list[int]] = {}


class DeviceTable:
    """An int64 table with its host copy; ``patch`` re-uploads only a slice that changed.

    Args:
        host: The table (a 1-D numpy int64 array; kept, and updated by ``patch``).
        device: Where the kernels read it.
    """

    def __init__(self, host: Any, device: torch.device):
        self.host = host
        self.device = device
        self.uploads = 1  # whole tables and slices sent to the device, for tests
        self.tensor = (
            self._staging(host).to(device, non_blocking=True)
            if device.type == "cuda"
            else torch.from_numpy(host.copy())
        )

    def _staging(self, values: Any) -> torch.Tensor:
        """A fresh pinned copy of ``values`` (the caching host allocator hands its block out again
        only after the copy that reads it ran)."""
        staging = torch.empty(values.shape[0], dtype=torch.int64, pin_memory=True)
        staging.numpy()[:] = values
        return staging

    def patch(self, start: int, values: Any) -> bool:
        """Make ``[start, start + len(values))`` hold ``values``; True when it had to upload."""
        end = start + values.shape[0]
        if (self.host[start:end] == values).all():
            return False
        self.host[start:end] = values
        self.uploads += 1
        if self.device.type == "cuda":
            self.tensor[start:end].copy_(self._staging(values), non_blocking=True)
        else:  # CPU (tests of the table logic): a plain copy
            self.tensor[start:end] = torch.from_numpy(values.copy())
        return True
