"""The fast step of :class:`~mfsdp_optim.optimizer.FullyShardedOptimizer` for torch's own
``Adam``/``AdamW`` with ``fused=True`` or ``foreach=True``.

The generic step binds ``alias.grad`` for every param, calls ``optimizer.step()`` (whose
``_init_group`` reads every grad and state entry back one param at a time) and unbinds: a few
microseconds of Python per param. Here the wrapper calls what ``Adam.step()`` itself calls, with
lists it keeps across steps:

* fused groups whose params, state and grads share one (device, dtype), no complex params:
  ``torch._foreach_add_(steps, 1)`` then ``torch._fused_adam_``/``torch._fused_adamw_``, the
  body of ``torch.optim.adam._fused_adam`` for its single (device, dtype) bucket;
* every other eligible group (foreach, or fused with several devices/dtypes): the functional
  ``torch.optim.adam.adam(...)`` with the arguments ``Adam.step()`` passes it.

Per group the cache holds the aliases (``group["params"]`` order) and the state lists (exp_avg,
exp_avg_sq, max_exp_avg_sq, step). The grads come from the wrapper's prepare loop, which appends
each param's local work grad to its group's list (``_Slot.fast_list``) in slot order, the order of
``group["params"]``. Params without a grad this step are left out of the lists, as
``_init_group`` leaves them out.

The cache is valid while the wrapper's ``_fast_version`` (bumped on alias re-binding,
``add_param_group``, ``load_state_dict``, ``sharded_state_dict`` and ``param_groups`` assignment)
is unchanged, the base optimizer's ``state`` is the same mapping object of the same size,
``param_groups`` holds the same group dicts with the same ``params`` list objects of the same
length, and each group's ``amsgrad`` is unchanged. Replacing a single entry of ``optimizer.state``
in place by hand (``state[p] = {...}`` for an existing ``p``) is not seen; call
``FullyShardedOptimizer._invalidate_fast_step()`` after doing so.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as _torch_optim_module
from torch.optim.adam import adam as _functional_adam

if TYPE_CHECKING:
    from .optimizer import FullyShardedOptimizer

__all__ = ["DISABLE_ENV", "FastAdamStep"]

DISABLE_ENV = "MFSDP_OPTIM_DISABLE_FAST_STEP"
_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "") == "1"


def _group_eligible(group: dict[str, Any]) -> bool:
    if group.get("capturable", False) or group.get("differentiable", False):
        return False
    if group.get("fused"):
        return True
    # foreach without capturable rejects a tensor lr in _init_group: leave that error to it
    return group.get("foreach") is True and not torch.is_tensor(group.get("lr"))


class _GroupCache:
    __slots__ = ("group", "params_list", "n", "amsgrad", "slots", "params", "exp_avgs",
                 "exp_avg_sqs", "max_exp_avg_sqs", "steps", "has_complex", "device",
                 "grads")

    def __init__(self, group: dict[str, Any]):
        self.group = group
        self.params_list = group["params"]
        self.n = len(self.params_list)
        self.amsgrad = bool(group["amsgrad"])
        self.slots: list[Any] = []
        self.params: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.max_exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []
        self.has_complex = False
        # the single (device, dtype) of params and state (and grads, see the wrapper) when the
        # fused kernel can be called directly; None: go through the functional API
        self.device: torch.device | None = None
        self.grads: list[torch.Tensor] = []  # filled by the wrapper's prepare loop


class FastAdamStep:
    """The cached lists and the bypass step; one per wrapper."""

    def __init__(self) -> None:
        self._groups: list[_GroupCache] | None = None
        self._version = -1
        self._state: object = None
        self._state_len = -1
        self._param_groups: object = None
        self._failed: tuple | None = None  # (version, id(state), len(state)) of a failed build

    # -----------------------------------------------------------------------------------------
    # eligibility

    @staticmethod
    def _static_ok(w: FullyShardedOptimizer) -> bool:
        """Everything but the cache: optimizer type, group flags, hooks, grad handling."""
        opt = w.optimizer
        if type(opt) not in _TYPES or _disabled():
            return False
        if w._precision_aware or w._decoupled_grad:
            return False
        if (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _torch_optim_module._global_optimizer_pre_hooks
                or _torch_optim_module._global_optimizer_post_hooks):
            return False
        # an instance-level step (an lr scheduler's counter, a user's patch) must run
        if "step" in vars(opt):
            return False
        # set by torch.amp.GradScaler for optimizers that take the scale themselves
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return False
        return all(_group_eligible(g) for g in opt.param_groups)

    def _cache_ok(self, w: FullyShardedOptimizer) -> bool:
        groups = self._groups
        if groups is None or self._version != w._fast_version:
            return False
        opt = w.optimizer
        state = opt.state
        if state is not self._state or len(state) != self._state_len:
            return False
        pgs = opt.param_groups
        if pgs is not self._param_groups or len(pgs) != len(groups):
            return False
        for gc, group in zip(groups, pgs):
            if (group is not gc.group or group["params"] is not gc.params_list
                    or len(gc.params_list) != gc.n or bool(group["amsgrad"]) != gc.amsgrad):
                return False
        return True

    def invalidate(self) -> None:
        self._groups = None
        self._failed = None

    # -----------------------------------------------------------------------------------------
    # the cache

    def _build(self, w: FullyShardedOptimizer) -> bool:
        opt = w.optimizer
        state = opt.state
        key = (w._fast_version, id(state), len(state))
        if self._failed == key:  # nothing changed since the last failed build
            return False
        self._groups = None
        for s in w._slots:
            s.fast_list = None
        groups = [_GroupCache(g) for g in opt.param_groups]
        # by the params list: torch's load_state_dict makes new group dicts around the same
        # params lists, while the wrapper's slots keep the dicts they were adopted with
        index = {id(gc.params_list): gc for gc in groups}
        for s in w._slots:
            if s.alias is None:
                continue
            gc = index.get(id(s.group["params"]))
            if gc is None:
                self._failed = key
                return False
            gc.slots.append(s)
        for gc in groups:
            params = gc.params_list
            if len(gc.slots) != len(params) or any(
                    s.alias is not p for s, p in zip(gc.slots, params)):
                self._failed = key  # the base optimizer's groups were changed behind our back
                return False
            need = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if gc.amsgrad else ())
            for p in params:
                st = state.get(p)
                if not st or any(k not in st for k in need) or not torch.is_tensor(st["step"]):
                    self._failed = key  # the generic step creates (or rejects) the state
                    return False
                gc.params.append(p)
                gc.exp_avgs.append(st["exp_avg"])
                gc.exp_avg_sqs.append(st["exp_avg_sq"])
                if gc.amsgrad:
                    gc.max_exp_avg_sqs.append(st["max_exp_avg_sq"])
                gc.steps.append(st["step"])
                if p.is_sparse:
                    self._failed = key
                    return False
            gc.has_complex = any(torch.is_complex(p) for p in params)
            gc.device = self._single_device(gc)
        for gc in groups:
            for s in gc.slots:
                s.fast_list = gc.grads
        self._groups = groups
        self._version = w._fast_version
        self._state = state
        self._state_len = len(state)
        self._param_groups = opt.param_groups
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

    def begin(self, w: FullyShardedOptimizer) -> bool:
        """Before the prepare loop: True when the loop should collect the grads for us (the
        cache is valid, built now if needed, and every other condition holds)."""
        self.clear()
        if not self._static_ok(w):
            return False
        return self._cache_ok(w) or self._build(w)

    def ready(self, w: FullyShardedOptimizer) -> bool:
        """At step time: nothing changed since :meth:`begin` collected the grads."""
        return self._static_ok(w) and self._cache_ok(w)

    def clear(self) -> None:
        """Drop the collected grads (no grad memory outlives the step through the cache)."""
        if self._groups is not None:
            for gc in self._groups:
                gc.grads.clear()

    def step(self, optimizer: torch.optim.Optimizer, grad_devices: set[torch.device],
             grad_scale: torch.Tensor | None = None, triton: Any = None) -> None:
        """``Adam.step()`` on the cached lists and the collected grads; ``grad_devices``: the
        devices of all the work grads (the direct fused call needs them on the group's);
        ``grad_scale``: what ``Adam.step()`` would read from ``optimizer.grad_scale`` (fused
        groups only; the wrapper's folded clip); ``triton``: the opt-in
        :class:`~mfsdp_optim._triton_adam.TritonAdam` for direct fused groups, or None."""
        assert self._groups is not None
        optimizer._accelerator_graph_capture_health_check()
        with torch.no_grad():
            for gc in self._groups:
                direct = gc.device is not None and all(d == gc.device for d in grad_devices)
                self._step_group(gc, direct, grad_scale, triton)

    @staticmethod
    def _step_group(gc: _GroupCache, direct: bool, grad_scale: torch.Tensor | None,
                    triton: Any = None) -> None:
        group = gc.group
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
        if not grads:
            return
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        device = gc.device
        if direct and device is not None:
            # torch.optim.adam._fused_adam for its one (device, dtype) bucket
            if torch.is_tensor(beta1) and beta1.dim() != 0:
                beta1 = beta1.squeeze()
            if torch.is_tensor(beta2) and beta2.dim() != 0:
                beta2 = beta2.squeeze()
            if torch.is_tensor(lr) and str(lr.device) != "cpu" and lr.device != device:
                lr = lr.to(device=device, non_blocking=True)
            if triton is not None and triton.step(group, params, grads, exp_avgs, exp_avg_sqs,
                                                  steps, grad_scale):
                return
            if grad_scale is not None:
                grad_scale = grad_scale.to(device, non_blocking=True)
            torch._foreach_add_(steps, 1)
            func = (torch._fused_adamw_ if group["decoupled_weight_decay"]
                    else torch._fused_adam_)
            func(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=group["amsgrad"], lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], grad_scale=grad_scale, found_inf=None,
            )
            return
        # exactly the call Adam.step() makes after _init_group
        _functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            amsgrad=group["amsgrad"], has_complex=gc.has_complex, beta1=beta1, beta2=beta2,
            lr=lr, weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"], foreach=group["foreach"],
            capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=grad_scale, found_inf=None,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )
