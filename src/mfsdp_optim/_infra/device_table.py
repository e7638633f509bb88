"""Persistent argument tables of the Triton kernels: built once, kept on the device, patched.

Both kernels of the package (the stats kernel in ``_fused``, the Adam step in ``_triton_adam``)
address every tensor of a list from the first one's pointer through an int64 table of element
offsets, numels and cumulative block counts. Building that table reads every tensor's address
on the host (about 0.1-0.3 us of Python per tensor and per list); for thousands of small
tensors that costs more than the kernel. So the tables are built once per (list identity,
layout) and kept on the device; at each step one check per list whose storage can move says
whether anything moved, and only the slice that changed is uploaded again (a fresh pinned
staging buffer and a non-blocking copy on the current stream: the copy is ordered after every
earlier launch that read the old slice, and no host sync is needed).

The check lives here, in ``same_addresses``: the tensors' ``data_ptr()`` against the addresses
the table was built from. On CUDA builds of torch it is ``torch._C.
_tensors_data_ptrs_at_indices_equal`` (the C++ loop cudagraph trees use for the same purpose);
elsewhere a Python comparison of the address list. ``benchmarks/bench_triton_adam.py
--check-cost`` measures both per tensor.

Which lists are checked at every step, and why nothing can go stale unseen:

* grads (both kernels): FSDP2 may re-allocate them at every backward, and a grad set to None
  and re-created may land anywhere. Their addresses are checked at every call; a changed one
  rebuilds that table's grad offsets. A re-created grad at the same address needs no change
  (offsets are derived from addresses only; layout checks below).
* the stats table holds nothing else: its numels are compared at every call too, so all of its
  content is re-verified against the tensors the caller holds during the call.
* params, exp_avg, exp_avg_sq and step counters (the Adam table): not checked per step (see
  ``CHECK_ALL_ENV``). The table lives on the fast step's per-group cache
  (``_fast_step._GroupCache``) and dies with it, and that cache holds the very tensor objects
  the table describes plus, in the table, their storages. Every path that gives the step other
  tensors replaces that cache: ``load_state_dict`` and ``sharded_state_dict`` call
  ``invalidate_caches()``; the base optimizer's own ``load_state_dict`` installs a new state
  mapping, and state created for new params changes its size (``_cache_ok`` compares both);
  params re-bound by FSDP2 (a new ``_local_tensor``, ``swap_tensors``, ``model.to()``) fail the
  local-tensor identity check (``locals_ok`` or the prepare plan's); changed param groups bump
  the slot table's version; ``invalidate_caches()`` drops it. A value replaced by hand inside
  ``optimizer.state[p]`` is not seen (as before: call ``invalidate_caches()``), but the old
  tensor is still held, so the kernel updates live memory, never freed memory; the same holds
  for a storage swapped under a held tensor (``t.set_()``, ``t.data = ...``): the table keeps
  the old storage alive. The one path neither seen nor covered is a storage resized in place
  (``t.resize_()`` to a larger size, ``t.untyped_storage().resize_()``) on a param's local
  shard or a state tensor; neither torch nor FSDP2 does that to them; set
  ``MFSDP_OPTIM_CHECK_ALL_ADDRESSES=1`` to check every list at every step.
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
    "check_all_lists",
    "same_addresses",
]

CHECK_ALL_ENV = "MFSDP_OPTIM_CHECK_ALL_ADDRESSES"

_bulk_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


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
