"""``step_whole_params``: the entry point, which validates, agrees, plans once and runs a recipe."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.agreement import RankMismatchError, agree, by_value, digest
from ._checks import check_whole_hyperparameters
from ._exchange import WORDING
from ._generic import generic_step
from ._muon import muon_step
from ._plan import WholeParamPlan, build_plan

REBUILD = 1  # the plan token of a rank that builds its plan at this step

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
        if not isinstance(p, DTensor):
            return f"param {name!r} is a {type(p).__name__}, expected a DTensor"
        if (
            g.device_mesh != p.device_mesh
            or tuple(g.placements) != tuple(p.placements)
            or g.shape != p.shape
        ):
            return (
                f"param {name!r}: its grad's layout {tuple(g.placements)} {tuple(g.shape)} is not "
                f"the param's {tuple(p.placements)} {tuple(p.shape)}; redistribute it first"
            )
        if g._local_tensor.shape != p._local_tensor.shape:
            return (
                f"param {name!r}: its grad's local shard is {tuple(g._local_tensor.shape)}, the "
                f"param's {tuple(p._local_tensor.shape)}: the grad does not hold this rank's "
                "piece of the param (built with DTensor.from_local from a wrong local tensor?)"
            )
        if recipe == "muon" and (torch.is_complex(p) or g.is_sparse):
            return f"param {name!r}: Muon takes neither complex params nor sparse grads"
    return None


def _disagreement(details: list) -> str:
    """Why the ranks' step digests differ, from every rank's (recipe, rebuilt, token)."""
    recipes = [d[0] for d in details]
    if len(set(recipes)) > 1:
        return (
            f"ranks step different whole-param recipes ({by_value(recipes)}): every rank must "
            "step the same optimizer classes in the same order; nothing was updated"
        )
    rebuilt = [r for r, d in enumerate(details) if d[1]]
    kept = [r for r, d in enumerate(details) if not d[1]]
    if rebuilt and kept:
        return (
            f"ranks {rebuilt} rebuilt the whole-param plan at this step and ranks {kept} did "
            "not: their params or param groups changed on some ranks only (a param moved into "
            "or out of a group, other param objects, a new state mapping) or "
            "invalidate_caches() was called on some ranks only. Change params, groups and "
            "caches on every rank together. Nothing was updated; the plan is dropped on every "
            "rank and rebuilt at the next step, which refuses param lists that still differ"
        )
    return (
        f"ranks hold different whole-param plans ({by_value([d[2] for d in details])}): they "
        "were built at different steps. Nothing was updated; the plan is dropped on every rank "
        "and rebuilt at the next step"
    )


def step_whole_params(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    *,
    group: dist.ProcessGroup | None = None,
    plan_cache: WholeParamPlan | None = None,
    names: Sequence[str] | None = None,
    batched_ns: bool | None = False,
    span_replicas: bool | None = None,
) -> WholeParamPlan:
    """Do what ``optimizer.step()`` does to the unsharded ``params`` with their global grads,
    each update computed on the whole param; returns the plan to pass as ``plan_cache`` next.

    Every rank of ``group`` (default WORLD) calls it at every step, with ``plan_cache=None`` on
    every rank at the same step (building a plan is one object all-gather). ``names`` (default:
    the params' positions in the optimizer's groups) identify a param across the ranks of its
    mesh. Reads ``p.grad`` (already unscaled and clipped), skipping params whose grad is None
    on every rank of its mesh (None on some ranks only is refused).

    Collectives, the same on every rank: the step's agreement (ONE all-reduce of 4 int64: the
    recipe's and the plan's digests (or "rebuilding"), a failing rank sending -1), the plan's
    object all-gather when every rank rebuilds, then Muon: 2 all-to-alls; any other class: 4
    (sizes, payload, each way); the generic path calls ``optimizer.step()`` once on every rank.
    Any exception on any rank, before or during the step, makes every rank raise (that rank
    its own error, the others ``RankFailedError`` naming it) with no param and no state changed
    on any rank; ranks whose plans differ (one rebuilt alone) raise ``RankMismatchError`` on
    every rank, and the plan is rebuilt on every rank at the next call.
    ``batched_ns``: Muon owners batch Newton-Schulz per matrix shape (True), where shown bit
    for bit on their device (None), or never (False); see ``_muon``.
    ``span_replicas`` (the same on every rank): one owner per param over all its replica
    groups (True), one per replica group (False), or per param where that moves fewer bytes
    (None; Muon always spans); see ``_plan.spans_replicas``. The result is the same either way.
    """
    where = _positions(optimizer)
    recipe = recipe_for(optimizer)
    if names is None:
        names = [
            "group{}.param{}".format(*where[id(p)]) if id(p) in where else f"unknown{i}"
            for i, p in enumerate(params)
        ]
    rebuild = plan_cache is None or not plan_cache.matches(params, recipe, span_replicas)
    error: BaseException | None = None
    try:  # local checks, before anything changes and before any byte moves
        check_whole_hyperparameters(optimizer)
        reason = _step_error(recipe, params, names)
        if reason is not None:
            raise ValueError(reason)
    except Exception as exc:
        error = exc
    token = REBUILD if rebuild else plan_cache.digest  # type: ignore[union-attr]
    # the step's agreement: ONE small all-reduce; an object gather only when it fails
    verdict = agree(error, group, digest=[*digest(recipe), token], detail=(recipe, rebuild, token))
    if not verdict.same and plan_cache is not None:
        plan_cache.broken = True  # on every rank alike (the verdict is): all rebuild next
    verdict.raise_own_or_peer(error, WORDING)
    if not verdict.same:
        raise RankMismatchError(_disagreement(verdict.details or []))
    if rebuild:
        errors = _build_errors(recipe, params, names, where)
        plan = build_plan(params, names, recipe, group, errors, span_replicas)
    else:
        plan = plan_cache  # type: ignore[assignment]
    group_index = [where[id(p)][0] for p in params]
    if recipe == "muon":
        groups = [optimizer.param_groups[gi] for gi in group_index]
        muon_step(optimizer, params, groups, plan, group, batched=batched_ns)
    else:
        generic_step(optimizer, params, group_index, plan, group)
    return plan
