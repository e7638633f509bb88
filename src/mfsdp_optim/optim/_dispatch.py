"""Which base step runs, and running it: the fast Adam step or the base optimizer's own.

Map: ``route_of`` the one eligibility check, from the base optimizer alone: a ``Route`` of
``fold_clip`` (torch's fused Adam/AdamW/SGD/Adagrad take the clip as ``grad_scale``) and
``fast`` (Adam/AdamW groups through ``_fast_step``, no ``step()`` call); ``DISABLE_*_ENV`` turn
either off. ``base_step`` the base optimizer's own ``step()`` on local shards (``_views``),
torch's global hooks held back (the wrapper fires them once). ``detect_precision_aware``.
Why each route needs what it checks: docs/concepts.md, "Which base step runs".
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch.optim import optimizer as _torch_optim

from ._fast_step import group_eligible
from ._slots import Slot
from ._views import local_shard_view

__all__ = [
    "DISABLE_CLIP_FOLD_ENV",
    "DISABLE_FAST_STEP_ENV",
    "Route",
    "base_step",
    "detect_precision_aware",
    "route_of",
]

DISABLE_CLIP_FOLD_ENV = "MFSDP_OPTIM_DISABLE_CLIP_FOLD"
DISABLE_FAST_STEP_ENV = "MFSDP_OPTIM_DISABLE_FAST_STEP"
_GRAD_SCALE_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_FAST_TYPES = (torch.optim.Adam, torch.optim.AdamW)


class Route(NamedTuple):
    fast: bool
    fold_clip: bool


def route_of(optimizer: torch.optim.Optimizer, *, precision_aware: bool) -> Route:
    """How this step may run (see the module docstring)."""
    kind = type(optimizer)
    groups = optimizer.param_groups
    if kind not in _GRAD_SCALE_TYPES or precision_aware or not groups:
        return Route(False, False)
    # set by torch.amp.GradScaler (or anyone else) for optimizers that take the scale themselves
    if (
        getattr(optimizer, "grad_scale", None) is not None
        or getattr(optimizer, "found_inf", None) is not None
    ):
        return Route(False, False)
    fold = os.environ.get(DISABLE_CLIP_FOLD_ENV) != "1" and all(
        g.get("fused") and not g.get("differentiable") for g in groups
    )
    fast = (
        kind in _FAST_TYPES
        and os.environ.get(DISABLE_FAST_STEP_ENV) != "1"
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and "step" not in vars(optimizer)
        and all(group_eligible(g) for g in groups)
    )
    return Route(fast, fold)


def detect_precision_aware(optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
    """(precision_aware, decoupled_grad) of ``optimizer``: an ``mfsdp_precision_aware``
    attribute decides; else Transformer Engine's FusedAdam with ``master_weights`` or
    ``use_decoupled_grad`` is precision-aware (detected only when TE is installed)."""
    decoupled = bool(getattr(optimizer, "use_decoupled_grad", False))
    explicit = getattr(optimizer, "mfsdp_precision_aware", None)
    if explicit is not None:
        return bool(explicit), decoupled
    try:  # optional accelerator, never required
        from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam
    except Exception:
        return False, decoupled
    if isinstance(optimizer, TEFusedAdam):
        return bool(getattr(optimizer, "master_weights", False)) or decoupled, decoupled
    return False, decoupled


@contextmanager
def global_hooks_held_back() -> Iterator[None]:
    """torch's global optimizer step hooks, emptied for the duration (the same dicts)."""
    dicts: list[Any] = [
        _torch_optim._global_optimizer_pre_hooks,
        _torch_optim._global_optimizer_post_hooks,
    ]
    held = [(d, list(d.items())) for d in dicts]
    for d, _ in held:
        d.clear()
    try:
        yield
    finally:
        for d, items in held:
            d.update(items)


def base_step(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[Slot],
    *,
    decoupled: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``optimizer.step()`` on the local shards of the held slots, their work grads bound.

    ``grad_scale``/``found_inf``: set on the optimizer for the call, the way
    ``torch.amp.GradScaler`` hands them to fused optimizers."""
    with local_shard_view(optimizer, slots) as pairs:
        bound: list[torch.Tensor] = []
        for s, (_, local) in zip((s for s in slots if s.held), pairs, strict=True):
            wg = s.work_grad
            if wg is None:
                continue
            lg = wg._local_tensor
            if decoupled:
                local.decoupled_grad = lg  # type: ignore[attr-defined]  # TE's attribute
            else:
                if lg.dtype != local.dtype:  # a precision-aware optimizer takes low precision
                    local.grad_dtype = None
                local.grad = lg
            bound.append(local)
        try:
            if grad_scale is not None:
                optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            if found_inf is not None:
                optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            with global_hooks_held_back():
                optimizer.step()
        finally:
            if grad_scale is not None:
                del optimizer.grad_scale  # type: ignore[attr-defined]
            if found_inf is not None:
                del optimizer.found_inf  # type: ignore[attr-defined]
            for a in bound:
                if decoupled:
                    a.decoupled_grad = None  # type: ignore[attr-defined]  # TE's attribute
                else:
                    a.grad = None
