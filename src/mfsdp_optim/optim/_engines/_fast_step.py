"""The Adam/AdamW fast step: torch's own multi-tensor kernels on cached local-tensor lists.

``FastAdamStep`` calls what ``Adam.step()`` calls after ``_init_group`` (fused or foreach,
``_route.Route``) on per-group lists of local shards it keeps (``_GroupCache``): bit-identical
to the base step. Valid while the slot table, ``optimizer.state`` (same mapping and size),
``param_groups`` and each group's ``amsgrad`` are unchanged and the params keep their local
tensors; ``FullyShardedOptimizer.invalidate_caches()`` after replacing a state value by hand.
Details: docs/concepts.md, "The Adam fast step".
"""

from __future__ import annotations

from operator import is_ as _is
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _functional_adam

from ._slots import Slot, SlotTable

__all__ = ["FastAdamStep", "advance_steps", "group_eligible"]


def advance_steps(steps: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
    """Add 1 to every step counter, or ``1 - found_inf`` (a float32 0/1 tensor on their device:
    a skipped update leaves them where they were).

    One multi-tensor launch where torch's ``_fused_adam`` adds 1 and then subtracts found_inf
    (two). The list overload, as in torch's own subtraction: a lone 0-d tensor there binds to
    the Scalar overload and is read on the host (a sync, seen on the H200 under
    ``set_sync_debug_mode("error")``)."""
    if found_inf is None:
        torch._foreach_add_(steps, 1)
    else:
        torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))


def group_eligible(group: dict[str, Any]) -> bool:
    """A param group the fast step can take (type and hook checks are ``_route``'s)."""
    if group.get("capturable", False) or group.get("differentiable", False):
        return False
    if group.get("fused"):
        return True
    # foreach without capturable rejects a tensor lr in _init_group: leave that error to it
    return group.get("foreach") is True and not torch.is_tensor(group.get("lr"))


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


class _GroupCache:
    __slots__ = (
        "group",
        "params_list",
        "n",
        "amsgrad",
        "slots",
        "dparams",
        "params",
        "exp_avgs",
        "exp_avg_sqs",
        "max_exp_avg_sqs",
        "steps",
        "has_complex",
        "device",
        "grads",
        "triton_table",
    )

    def __init__(self, group: dict[str, Any]):
        self.group = group
        self.params_list = group["params"]
        self.n = 0  # params the fast step takes in this group (held on this rank)
        self.amsgrad = bool(group["amsgrad"])
        self.slots: list[Slot] = []
        self.dparams: list[DTensor] = []
        self.params: list[torch.Tensor] = []  # their local shards, at build time
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.max_exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.has_complex = False
        # the single (device, dtype) of params and state (and grads, see the wrapper) when the
        # fused kernel can be called directly; None: go through the functional API
        self.device: torch.device | None = None
        self.grads: list[torch.Tensor] = []  # filled by the wrapper's prepare loop
        # the Triton step's launch table of these lists (_triton_adam.AdamTable): it
        # lives and dies with this cache, so every path that replaces the cache drops it
        self.triton_table: Any = None


class FastAdamStep:
    """The cached lists and the bypass step; one per wrapper."""

    def __init__(self) -> None:
        self._groups: list[_GroupCache] | None = None
        self._table_version = -1
        self._state: object = None
        self._state_len = -1
        self._param_groups: object = None
        self._failed: tuple | None = None  # (version, id(state), len(state)) of a failed build
        # OptimizerConfig(cuda_graph=True): each group's lr in device memory (a
        # _graph.ScalarSlots, float32 as torch's fused kernel takes a tensor lr), read by the
        # direct fused call instead of the Python lr; and whether a capture is under way
        self.lr_slots: Any = None
        self.capturing = False

    @property
    def token(self) -> object:
        """Identifies the current cache (the prepare plan indexes its grad lists by it)."""
        return self._groups

    def groups(self) -> list[_GroupCache] | None:
        """The per-group caches (their lists, Triton tables and state), None while none is
        built: what a captured step reads and keeps alive."""
        return self._groups

    def _cache_ok(self, optimizer: torch.optim.Optimizer, table: SlotTable) -> bool:
        groups = self._groups
        if groups is None or self._table_version != table.version:
            return False
        state = optimizer.state
        if state is not self._state or len(state) != self._state_len:
            return False
        pgs = optimizer.param_groups
        if pgs is not self._param_groups or len(pgs) != len(groups):
            return False
        for gc, group in zip(groups, pgs, strict=True):
            if (
                group is not gc.group
                or group["params"] is not gc.params_list
                or bool(group["amsgrad"]) != gc.amsgrad
            ):
                return False
        return True

    def locals_ok(self) -> bool:
        """Every param still has the local tensor the cache holds (FSDP2 may replace it)."""
        assert self._groups is not None
        return all(
            all(map(_is, [p._local_tensor for p in gc.dparams], gc.params)) for gc in self._groups
        )

    def invalidate(self) -> None:
        self._groups = None
        self._failed = None

    def _build(self, optimizer: torch.optim.Optimizer, table: SlotTable) -> bool:
        state = optimizer.state
        key = (table.version, id(state), len(state))
        if self._failed == key:  # nothing changed since the last failed build
            return False
        self._groups = None
        for s in table.slots:
            s.fast_list = None
        groups = [_GroupCache(g) for g in optimizer.param_groups]
        for s in table.slots:
            if s.held:
                groups[s.group_index].slots.append(s)
        for gc in groups:
            gc.n = len(gc.slots)
            need = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if gc.amsgrad else ())
            for s in gc.slots:
                st = state.get(s.param)
                if (
                    not st
                    or any(k not in st for k in need)
                    or not torch.is_tensor(st["step"])
                    or isinstance(st["step"], DTensor)
                    or s.param.is_sparse
                ):
                    self._failed = key  # the generic step creates (or rejects) the state
                    return False
                gc.dparams.append(s.param)
                gc.params.append(s.param._local_tensor)
                gc.exp_avgs.append(_local(st["exp_avg"]))
                gc.exp_avg_sqs.append(_local(st["exp_avg_sq"]))
                if gc.amsgrad:
                    gc.max_exp_avg_sqs.append(_local(st["max_exp_avg_sq"]))
                gc.steps.append(st["step"])
            gc.has_complex = any(torch.is_complex(p) for p in gc.params)
            gc.device = self._single_device(gc)
        for gc in groups:
            for s in gc.slots:
                s.fast_list = gc.grads
        self._groups = groups
        self._table_version = table.version
        self._state = state
        self._state_len = len(state)
        self._param_groups = optimizer.param_groups
        self._failed = None
        return True

    @staticmethod
    def _single_device(gc: _GroupCache) -> torch.device | None:
        """The device when params and state all share one (device, dtype) and the fused step
        state lives there as float32 (what the fused optimizer creates); else None."""
        if not gc.group.get("fused") or gc.has_complex or not gc.params:
            return None
        p0 = gc.params[0]
        device, dtype = p0.device, p0.dtype
        for t in (*gc.params, *gc.exp_avgs, *gc.exp_avg_sqs, *gc.max_exp_avg_sqs):
            if t.device != device or t.dtype != dtype:
                return None
        for t in gc.steps:
            if t.device != device or t.dtype != torch.float32:
                return None
        return device

    # -----------------------------------------------------------------------------------------
    # the step

    def begin(
        self, optimizer: torch.optim.Optimizer, table: SlotTable, trust_locals: bool = False
    ) -> object | None:
        """Before the prepare loop (the route allows the fast step): the cache's token when the
        loop should collect the grads for it (valid, built now if needed), else None.
        ``trust_locals``: the prepare plan will vouch for the params' local tensors (it checks
        them list-wide; the caller checks ``locals_ok()`` itself if the plan does not
        replay)."""
        self.clear()
        valid = self._cache_ok(optimizer, table) and (trust_locals or self.locals_ok())
        if not valid and not self._build(optimizer, table):
            return None
        return self._groups

    def ready(self, optimizer: torch.optim.Optimizer, table: SlotTable) -> bool:
        """At step time: nothing changed since ``begin()`` collected the grads."""
        return self._cache_ok(optimizer, table)

    def clear(self) -> None:
        """Drop the collected grads (no grad memory outlives the step through the cache)."""
        if self._groups is not None:
            for gc in self._groups:
                gc.grads.clear()

    def skips_on_device(self) -> bool:
        """Every group is fused: its kernels take ``found_inf`` and skip the update on the
        device (torch's ``_fused_adam`` contract), step counters restored."""
        return self._groups is not None and all(bool(gc.group.get("fused")) for gc in self._groups)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        grad_devices: set[torch.device],
        grad_scale: torch.Tensor | None = None,
        triton: Any = None,
        found_inf: torch.Tensor | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        """``Adam.step()`` on the cached lists and the collected grads; ``grad_devices``: the
        devices of all the work grads (the direct fused call needs them on the group's);
        ``grad_dtype``: the one dtype of all the work grads, when they have one;
        ``grad_scale``: what ``Adam.step()`` would read from ``optimizer.grad_scale`` (fused
        groups only; the wrapper's folded clip); ``triton``: the
        ``TritonAdam`` for direct fused groups (``triton_adam_step``), or None;
        ``found_inf``: a float32 0/1 tensor, fused groups only (see ``skips_on_device()``):
        the update is skipped on the device where it is 1."""
        assert self._groups is not None
        if not self.capturing:  # torch's check refuses a capture of capturable=False groups
            optimizer._accelerator_graph_capture_health_check()
        slots = self.lr_slots
        if slots is not None and len(slots) != len(self._groups):
            slots = None  # groups were added: the wrapper makes new slots at its next step()
        elif slots is not None and not self.capturing:  # (a capture uploads nothing)
            slots.update([gc.group["lr"] for gc in self._groups])
        with torch.no_grad():
            for gi, gc in enumerate(self._groups):
                direct = gc.device is not None and all(d == gc.device for d in grad_devices)
                lr = None if slots is None else slots.slot(gi)
                self._step_group(gc, direct, grad_scale, triton, found_inf, grad_dtype, lr)

    @staticmethod
    def _step_group(
        gc: _GroupCache,
        direct: bool,
        grad_scale: torch.Tensor | None,
        triton: Any = None,
        found_inf: torch.Tensor | None = None,
        grad_dtype: torch.dtype | None = None,
        lr_slot: torch.Tensor | None = None,
    ) -> None:
        """One group's update, in three phases: its lists over the params with a grad
        (``_lists_with_grads``), then torch's fused kernel or the Triton step on the group's one
        (device, dtype) bucket where ``direct`` (``_step_fused``), else torch's functional Adam,
        exactly as ``Adam.step()`` calls it (``_step_functional``). ``lr_slot``: a 0-d float32
        device tensor the direct fused call reads the lr from (the captured step's; the Triton
        kernel reads its own table)."""
        holder, lists = _lists_with_grads(gc)
        if not lists.grads:
            return
        if direct and gc.device is not None:
            _step_fused(gc, lists, holder, grad_scale, triton, found_inf, grad_dtype, lr_slot)
            return
        _step_functional(gc, lists, grad_scale, found_inf)


class _StepLists(NamedTuple):
    """One group's lists for one step: over the params that have a grad."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]


def _lists_with_grads(gc: _GroupCache) -> tuple[_GroupCache | None, _StepLists]:
    """The group's lists over the params with a grad this step, and the holder of their Triton
    table: the cache itself where every param has one (its own lists), else None (lists of this
    step only)."""
    holder: _GroupCache | None = gc  # the Triton table may live on the cache: its lists
    grads = gc.grads
    params, exp_avgs, exp_avg_sqs = gc.params, gc.exp_avgs, gc.exp_avg_sqs
    max_exp_avg_sqs, steps = gc.max_exp_avg_sqs, gc.steps
    if len(grads) != gc.n:  # some params have no grad this step: _init_group skips them
        keep = [j for j, s in enumerate(gc.slots) if s.work_grad is not None]
        assert len(keep) == len(grads)
        params = [params[j] for j in keep]
        exp_avgs = [exp_avgs[j] for j in keep]
        exp_avg_sqs = [exp_avg_sqs[j] for j in keep]
        if gc.amsgrad:
            max_exp_avg_sqs = [max_exp_avg_sqs[j] for j in keep]
        steps = [steps[j] for j in keep]
        holder = None  # lists of this step only
    return holder, _StepLists(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)


def _step_fused(
    gc: _GroupCache,
    lists: _StepLists,
    holder: _GroupCache | None,
    grad_scale: torch.Tensor | None,
    triton: Any,
    found_inf: torch.Tensor | None,
    grad_dtype: torch.dtype | None,
    lr_slot: torch.Tensor | None,
) -> None:
    """``torch.optim.adam._fused_adam`` for the group's one (device, dtype) bucket, or the
    Triton step where it takes the group (``triton.step`` returns True)."""
    group, device = gc.group, gc.device
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    if torch.is_tensor(beta1) and beta1.dim() != 0:
        beta1 = beta1.squeeze()
    if torch.is_tensor(beta2) and beta2.dim() != 0:
        beta2 = beta2.squeeze()
    if torch.is_tensor(lr) and str(lr.device) != "cpu" and lr.device != device:
        lr = lr.to(device=device, non_blocking=True)
    if found_inf is not None:
        found_inf = found_inf.to(device, non_blocking=True)
    if triton is not None and triton.step(
        group,
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        grad_scale,
        holder,
        grad_dtype,
        found_inf,
    ):
        return
    if grad_scale is not None:
        grad_scale = grad_scale.to(device, non_blocking=True)
    if lr_slot is not None:
        lr = lr_slot
    advance_steps(steps, found_inf)
    func = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
    func(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        amsgrad=group["amsgrad"],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def _step_functional(
    gc: _GroupCache,
    lists: _StepLists,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """Exactly the call ``Adam.step()`` makes after ``_init_group``."""
    group = gc.group
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    beta1, beta2 = group["betas"]
    _functional_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        amsgrad=group["amsgrad"],
        has_complex=gc.has_complex,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        grad_scale=grad_scale,
        found_inf=found_inf,
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )
