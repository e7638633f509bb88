"""Preparing the grads for one step: pick each param's work grad, cast, bucket, unscale.

``Preparer.collect`` visits every slot once: the work grad is the param's grad, or a copy in
the param's dtype where they differ (unless the base optimizer is precision-aware); its local
shard goes into its stats bucket and, for the Adam fast step, into its group's grad list. After
a step in which nothing needed a cast, the visit is recorded as a ``PreparePlan``; later steps
whose grads carry the same spec objects and dtypes and whose params hold the same local tensors
(checked over whole lists) replay it without the per-param loop. ``restore`` copies cast grads
back into the originals after the base step, so ``p.grad`` keeps its dtype and object.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter
from operator import is_ as _is
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.grouping import by_device, pairs_by_device_dtype
from ..._infra.placement import in_layout_of
from ...stats.seam import BucketKey, Buckets, layout_of
from ._slots import Slot

__all__ = ["PreparePlan", "Preparer"]

_grad_of = attrgetter("grad")


class PreparePlan:
    """What a steady ``collect`` found, to replay it with a few list-wide identity checks."""

    __slots__ = (
        "slots",
        "n",
        "cast_grads",
        "params",
        "specs",
        "dtypes",
        "locals",
        "buckets",
        "fast_token",
        "fast_lists",
    )

    def __init__(
        self, slots: list[Slot], cast_grads: bool, keys: list[BucketKey], fast_token: object
    ):
        self.slots = slots
        self.n = len(slots)
        self.cast_grads = cast_grads
        self.params = [s.param for s in slots]
        self.specs = [s.grad_spec for s in slots]
        self.dtypes = [s.grad_dtype for s in slots]
        self.locals = [s.param._local_tensor for s in slots]
        by_key: dict[BucketKey, list[int]] = {}
        for i, key in enumerate(keys):
            by_key.setdefault(key, []).append(i)
        # None: the bucket holds every grad in slot order (the common case: no gather needed)
        self.buckets = [(k, None if len(idx) == self.n else idx) for k, idx in by_key.items()]
        self.fast_token: object = None
        self.fast_lists: list[tuple[list[torch.Tensor], list[int] | None]] = []
        self.index_fast_lists(fast_token)

    def index_fast_lists(self, fast_token: object) -> None:
        """Which slots feed which of the fast step's per-group grad lists."""
        by_list: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        for i, s in enumerate(self.slots):
            if s.fast_list is not None:
                by_list.setdefault(id(s.fast_list), (s.fast_list, []))[1].append(i)
        self.fast_lists = [
            (fl, None if len(idx) == self.n else idx) for fl, idx in by_list.values()
        ]
        self.fast_token = fast_token

    def replay(
        self, slots: list[Slot], cast_grads: bool, fast_token: object | None
    ) -> Buckets | None:
        """This step's buckets with each slot's ``work_grad`` set and the fast lists filled
        (``fast_token``: the fast step's current cache, None when it does not run); None when
        anything differs from the recorded step."""
        if slots is not self.slots or len(slots) != self.n or cast_grads != self.cast_grads:
            return None
        params = self.params
        # the same grad objects, without the torch-function dispatch a tensor subclass's
        # property getter pays (about half the cost of reading .grad of a DTensor param)
        with torch._C.DisableTorchFunctionSubclass():
            grads = list(map(_grad_of, params))
        try:
            locals_ = [g._local_tensor for g in grads]
        except AttributeError:  # a param without a grad this step, or a plain-tensor grad
            return None
        if not (
            all(map(_is, [g._spec for g in grads], self.specs))
            # torch.dtype objects are singletons: list equality is identity, without a pass
            and [t.dtype for t in locals_] == self.dtypes
            and all(map(_is, [p._local_tensor for p in params], self.locals))
        ):
            return None
        for slot, g in zip(slots, grads, strict=True):
            slot.work_grad = g  # type: ignore[assignment]  # a DTensor param's grad
        if fast_token is not None:
            if fast_token is not self.fast_token:  # the fast cache was rebuilt
                self.index_fast_lists(fast_token)
            for fl, idx in self.fast_lists:
                fl.extend(locals_ if idx is None else [locals_[i] for i in idx])
        return {
            k: (locals_ if idx is None else [locals_[i] for i in idx]) for k, idx in self.buckets
        }


class Preparer:
    """The per-step grad state of one wrapper: work grads, cast copies, the recorded plan."""

    def __init__(self) -> None:
        self.plan: PreparePlan | None = None
        self.any_cast = False  # whether collect made dtype-cast copies to restore
        self.work_locals: Buckets = {}
        self.replays = 0  # how many collects replayed the plan (for tests and diagnostics)
        self.replayed = False  # whether the last collect did

    def collect(
        self,
        slots: list[Slot],
        *,
        cast_grads: bool,
        group: dist.ProcessGroup | None,
        fast_token: object | None,
    ) -> Buckets:
        """Set every slot's work grad and bucket the local shards (see the module docstring).
        Raises TypeError/ValueError on a grad that cannot be used (e.g. a plain tensor)."""
        self.any_cast = False
        buckets = None if self.plan is None else self.plan.replay(slots, cast_grads, fast_token)
        self.replayed = buckets is not None
        if buckets is None:
            buckets = self._full_loop(slots, cast_grads, group, fast_token)
        else:
            self.replays += 1
        self.work_locals = buckets
        return buckets

    def _full_loop(
        self,
        slots: list[Slot],
        cast_grads: bool,
        group: dist.ProcessGroup | None,
        fast_token: object | None,
    ) -> Buckets:
        self.plan = None
        buckets: Buckets = defaultdict(list)
        keys: list[BucketKey] = []
        fast = fast_token is not None
        for i, s in enumerate(slots):
            g: Any = s.param.grad
            s.saved_grad = None
            s.work_grad = g
            fl = s.fast_list if fast else None
            if g is None:
                continue
            if not isinstance(g, DTensor):
                s.work_grad = None
                raise TypeError(
                    f"the grad of {s.fqn!r} is a {type(g).__name__}, expected a DTensor like its "
                    "param: FSDP2 produces DTensor grads. If you set .grad by hand, wrap it with "
                    "DTensor.from_local(grad, param.device_mesh, param.placements)."
                )
            local = g._local_tensor
            key = s.bucket_key
            if g._spec is not s.grad_spec or local.dtype is not s.grad_dtype:
                info = layout_of(g, i, group)  # validates; cached per spec
                dtype = s.param.dtype if cast_grads else local.dtype
                key = s.bucket_key = (local.device, dtype, info.replication, info.canonical)
                s.grad_spec, s.grad_dtype = g._spec, local.dtype
            # set above the first time: grad_spec starts as None, which no grad's spec is
            assert key is not None
            if cast_grads and local.dtype is not key[1]:
                s.saved_grad = g
                local = local.to(key[1])
                s.work_grad = in_layout_of(local, g)
                self.any_cast = True
            buckets[key].append(local)
            keys.append(key)
            if fl is not None:
                fl.append(local)
        if len(keys) == len(slots) and not self.any_cast:
            self.plan = PreparePlan(slots, cast_grads, keys, fast_token)
        return buckets

    def unscale(self, inv_scale_on, buckets: Buckets) -> None:
        """Multiply every bucketed local grad by the inverse loss scale, in float32 math."""
        for device, tensors in by_device(t for ts in buckets.values() for t in ts).items():
            # its own found_inf is unused: the stats collective decides, for every rank together
            scratch = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, scratch, inv_scale_on(device))

    def restore(self, slots: list[Slot]) -> None:
        """Copy cast work grads back into the original grads; drop every work grad."""
        self.work_locals = {}
        if not self.any_cast:
            for s in slots:
                s.work_grad = None
            return
        pairs = []
        for s in slots:
            if s.saved_grad is not None and s.work_grad is not None:
                pairs.append((s.saved_grad, s.work_grad))
            s.work_grad = None
            s.saved_grad = None
        self.any_cast = False
        for dst, src in pairs_by_device_dtype(pairs).values():
            torch._foreach_copy_(dst, src)

    def drop(self, slots: list[Slot]) -> None:
        """Forget the work grads without copying anything back (zero_grad)."""
        for s in slots:
            s.work_grad = None
            s.saved_grad = None
        self.work_locals = {}
        self.any_cast = False
