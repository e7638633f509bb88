"""The one place that chooses how a base optimizer's step runs: its engine and its route.

Three step engines exist: ``FAST`` (``_fast_step``: torch's fused/foreach Adam/AdamW kernels, or
the Triton step, on lists of local shards; no ``step()`` call), ``WHOLE`` (``optim/_whole``: the
update computed on whole params, for the ``whole_param`` update kind) and ``BASE``
(``_base_step``: the optimizer's own ``step()`` on a local-shard view). The choice is made in
two places of each step, both here:

* ``route_for`` at collect (``Engine.collect``), from the base optimizer and its update kind
  alone: a ``Route`` of ``fast`` (Adam/AdamW groups the fast step may take, no step hooks, no
  patched ``step()``) and ``fold_clip`` (torch's fused Adam/AdamW/SGD/Adagrad take the clip as
  ``grad_scale``); a ``whole_param`` class takes neither. ``DISABLE_*_ENV`` turn either off.
* ``step_engine`` at the step (``Engine.step``): ``FAST`` where the route was fast and the fast
  step's caches are still ready, else ``WHOLE`` for a ``whole_param`` class, else ``BASE``.

``detect_precision_aware`` tells a precision-aware base optimizer (it takes low-precision grads:
no cast, no fast step). The captured step (``optim/_captured``) refuses to capture a step that
did not take ``FAST`` or Muon's ``WHOLE`` on the device. Why each route needs what it checks:
docs/concepts.md, "Which base step runs".
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from .._kinds._kind_of import WHOLE_PARAM
from ._fast_step import group_eligible

__all__ = [
    "BASE",
    "DISABLE_CLIP_FOLD_ENV",
    "DISABLE_FAST_STEP_ENV",
    "FAST",
    "WHOLE",
    "Route",
    "detect_precision_aware",
    "route_for",
    "route_of",
    "step_engine",
]

DISABLE_CLIP_FOLD_ENV = "MFSDP_OPTIM_DISABLE_CLIP_FOLD"
DISABLE_FAST_STEP_ENV = "MFSDP_OPTIM_DISABLE_FAST_STEP"
_GRAD_SCALE_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_FAST_TYPES = (torch.optim.Adam, torch.optim.AdamW)
FAST, WHOLE, BASE = "fast", "whole", "base"  # the step engines (see the module docstring)


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


def route_for(optimizer: torch.optim.Optimizer, kind: str, *, precision_aware: bool) -> Route:
    """This step's route of a base optimizer of update kind ``kind``: none for a
    ``whole_param`` class (its update runs on whole params), else ``route_of``."""
    route = route_of(optimizer, precision_aware=precision_aware)
    if kind == WHOLE_PARAM:
        route = Route(False, False)
    return route


def step_engine(kind: str, *, fast_ready: bool) -> str:
    """Which engine runs this step's update: ``FAST`` where the route was fast and the fast
    step's caches are ready (``fast_ready``), else ``WHOLE`` for a ``whole_param`` class, else
    ``BASE``."""
    if fast_ready:
        return FAST
    return WHOLE if kind == WHOLE_PARAM else BASE


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
