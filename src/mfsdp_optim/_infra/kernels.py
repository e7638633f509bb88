"""Device helpers that the package's Triton kernels share (the stats kernel in ``stats._fused``,
the Adam update in ``optim._engines._triton_adam``): Triton device functions, the SM count, and
the element offsets through which a kernel addresses every tensor of a list from the first one's
pointer. Nothing here imports Triton until a kernel asks for it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["device_helpers", "element_offsets", "sm_count_of"]

_helpers: dict[str, Any] = {}
_sm_count: dict[int, int] = {}


def device_helpers() -> dict[str, Any]:
    """Triton device functions shared with the other kernels of the package (built once, after
    Triton imported)."""
    helpers = _helpers.get("helpers")
    if helpers is None:
        import triton
        import triton.language as tl

        @triton.jit
        def first_tensor(cum_ptr, n, item):
            # The tensor that holds work item ``item``: the largest t with cum[t] <= item, where
            # cum (n + 1 entries) counts the items of the tensors before t.
            lo = tl.full([], 0, tl.int32)
            hi = n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                ok = tl.load(cum_ptr + mid) <= item
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            return lo

        helpers = _helpers["helpers"] = {"first_tensor": first_tensor}
        globals().update(tl=tl)  # its globals are this module's (Triton's interpreter reads them)
    return helpers


def sm_count_of(device: torch.device) -> int:
    """The device's SM count (cached: the property query costs microseconds)."""
    sms = _sm_count.get(device.index)  # type: ignore[arg-type]
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _sm_count[device.index] = sms  # type: ignore[index]
    return sms


def element_offsets(ptrs: Any, esize: int) -> tuple[Any, bool] | None:
    """Offsets in elements of the addresses ``ptrs`` (numpy int64) from the first one, and
    whether every address is 16-byte aligned; None if an offset is not a whole number of
    elements (the kernels address every tensor from the first one's pointer)."""
    delta = ptrs - ptrs[0]
    if (delta % esize).any():
        return None
    return delta // esize, not (ptrs & 15).any()
