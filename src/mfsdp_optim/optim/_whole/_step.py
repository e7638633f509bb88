"""``step_whole_params``: the entry point, which validates, plans once and runs a recipe."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._generic import generic_step
from ._muon import muon_step
from ._plan import WholeParamPlan, build_plan

__all__ = ["recipe_for", "step_whole_params"]


def recipe_for(optimizer: torch.optim.Optimizer) -> str:
    """``"muon"`` for torch.optim.Muon (and subclasses keeping its step), else ``"generic"``."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and type(optimizer).step is muon.step:
        return "muon"
    return "generic"


def _positions(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int]]:
    return {
        id(p): (gi, j)
        for gi, g in enumerate(optimizer.param_groups)
        for j, p in enumerate(g["params"])
    }


def _build_errors(recipe: str, params: Sequence[DTensor], names: Sequence[str], where) -> list[str]:
    errors = []
    for p, name in zip(params, names, strict=True):
        if id(p) not in where:
            errors.append(f"param {name!r} is in none of the optimizer's param groups")
        elif recipe == "muon" and p.dim() != 2:
            errors.append(f"param {name!r} has shape {tuple(p.shape)}: Muon takes 2-D params")
    return errors


def _step_error(recipe: str, params: Sequence[DTensor], names: Sequence[str]) -> str | None:
    """The first reason this rank cannot step (checked every step, without a collective)."""
    for p, name in zip(params, names, strict=True):
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            return f"param {name!r}: its grad is a {type(g).__name__}, expected a DTensor"
        if (
            g.device_mesh != p.device_mesh
            or tuple(g.placements) != tuple(p.placements)
            or g.shape != p.shape
        ):
            return (
                f"param {name!r}: its grad's layout {tuple(g.placements)} {tuple(g.shape)} is not "
                f"the param's {tuple(p.placements)} {tuple(p.shape)}; redistribute it first"
            )
        if recipe == "muon" and (torch.is_complex(p) or g.is_sparse):
            return f"param {name!r}: Muon takes neither complex params nor sparse grads"
    return None


def step_whole_params(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    *,
    group: dist.ProcessGroup | None = None,
    plan_cache: WholeParamPlan | None = None,
    names: Sequence[str] | None = None,
    batched_ns: bool = False,
) -> WholeParamPlan:
    """Do what ``optimizer.step()`` does to the unsharded ``params`` with their global grads,
    each update computed on the whole param; returns the plan to pass as ``plan_cache`` next.

    Every rank of ``group`` (default WORLD) calls it at every step, with ``plan_cache=None`` on
    every rank at the same step (building a plan is one object all-gather). ``names`` (default:
    the params' positions in the optimizer's groups) identify a param across the ranks of its
    mesh. Reads ``p.grad`` (already unscaled and clipped), skipping params whose grad is None.
    Muon: 2 all-to-alls; any other class: 4 (sizes, payload, each way); the generic path calls
    ``optimizer.step()`` once on every rank. A rank that fails locally still takes part and
    then raises; its peers raise RuntimeError after the exchange instead of waiting.
    ``batched_ns``: Muon owners batch Newton-Schulz per matrix shape (see ``_muon``).
    """
    where = _positions(optimizer)
    recipe = recipe_for(optimizer)
    if names is None:
        names = [
            "group{}.param{}".format(*where[id(p)]) if id(p) in where else f"unknown{i}"
            for i, p in enumerate(params)
        ]
    if plan_cache is None:
        plan = build_plan(params, names, recipe, group, _build_errors(recipe, params, names, where))
        error = None
    else:
        plan = plan_cache
        error = (
            None
            if plan.matches(params, recipe)
            else (
                "plan_cache was built for other params or another optimizer class; pass "
                "plan_cache=None on every rank at the same step to rebuild it"
            )
        )
    if error is None:
        error = _step_error(recipe, params, names)
    if not plan.matches(params, recipe):
        # no exchange of this plan lines up with these params: a caller bug, raised locally
        raise ValueError(error)
    group_index = [where[id(p)][0] for p in params]
    if recipe == "muon":
        groups = [optimizer.param_groups[gi] for gi in group_index]
        muon_step(optimizer, params, groups, plan, group, error, batched=batched_ns)
    else:
        generic_step(optimizer, params, group_index, plan, group, error)
    return plan
