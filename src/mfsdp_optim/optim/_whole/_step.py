"""``step_whole_params``: the entry point, which validates, agrees, plans once and runs a recipe.

Three protocols, by ``host_sync`` and recipe: host-synced (the agreement and every status word
read on the host; any failure raises on every rank); Muon under ``host_sync=False``
(``_verdict``: the agreement and the status words stay on the device, the writes are gated on
them, a steady step reads nothing on the host); the generic path under ``host_sync=False``
(its host-side values, headers and status words travel through a gloo group of the same ranks,
``comm.host_group_of``, so it reads nothing back from the device and still raises on every
rank). A step that builds its plan reads the host in every protocol (one object gather).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.agreement import RankMismatchError, agree, by_value, digest
from ..._infra.attempt import Attempt
from ..._infra.comm import collective_device, host_group_of
from ._checks import check_whole_hyperparameters
from ._exchange import WORDING
from ._generic import generic_step
from ._muon import muon_step, muon_take_part
from ._plan import WholeParamPlan, build_plan
from ._verdict import DeviceVerdict, agree_on_device

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


def _check_locally(
    optimizer: torch.optim.Optimizer, recipe: str, params: Sequence[DTensor], names: Sequence[str]
) -> None:
    """Raise where this rank cannot step: its hyperparameters, or a param's grad."""
    check_whole_hyperparameters(optimizer)
    reason = _step_error(recipe, params, names)
    if reason is not None:
        raise ValueError(reason)


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
    verdict: DeviceVerdict | None = None,
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

    ``verdict`` (``OptimizerConfig(host_sync=False)``, the same on every rank): nothing is read
    back from the device at a step that keeps its plan. Muon: the agreement is ONE all-reduce
    of 6 int64 whose result stays on the device (``agree_on_device``), the exchanges' sizes
    follow the plan alone, and a failure or disagreement anywhere sets ``verdict.bad`` on every
    rank and gates every write: the failing rank raises its own error, the others return with
    nothing changed (their caller reports it). The generic path: the protocol above with its
    agreement, headers and status words on a gloo group of the same ranks (made at its first
    such step), raising on every rank. A step that builds the plan (the first, or after the
    params or caches changed) reads the agreement on the host (a failure found before it
    raises on every rank), then steps Muon on the device; a rank that rebuilds alone while
    its peers keep their plan takes part in their Muon exchanges with filler (from the plan it
    dropped) and raises ``RankMismatchError``, the peers' step is refused on the device. A rank
    that raises under ``verdict`` finds the plan its step ran with in ``verdict.plan`` (its
    peers return it): pass that as ``plan_cache`` next.
    """
    where = _positions(optimizer)
    recipe = recipe_for(optimizer)
    if names is None:
        names = [
            "group{}.param{}".format(*where[id(p)]) if id(p) in where else f"unknown{i}"
            for i, p in enumerate(params)
        ]
    rebuild = plan_cache is None or not plan_cache.matches(params, recipe, span_replicas)
    host_group = group
    if verdict is not None and recipe != "muon":
        host_group = host_group_of(group)  # made at the first such step, on every rank
    checks = Attempt()  # local checks, before anything changes and before any byte moves
    checks.run(_check_locally, optimizer, recipe, params, names)
    error = checks.exception
    token = REBUILD if rebuild else plan_cache.digest  # type: ignore[union-attr]
    detail = (recipe, rebuild, token)
    on_device = verdict is not None and recipe == "muon"
    if on_device:
        assert verdict is not None
        steady = _agree_on_device(error, recipe, token, rebuild, plan_cache, group, verdict)
        if steady:  # no host read: the plan is the one every rank agreed on when it was built
            verdict.plan = plan_cache
            groups = [optimizer.param_groups[where[id(p)][0]] for p in params]
            muon_step(optimizer, params, groups, plan_cache, group, batched_ns, verdict)  # type: ignore[arg-type]
            return plan_cache  # type: ignore[return-value]
    else:  # the step's agreement: ONE small all-reduce; an object gather only when it fails
        agreed = checks.verdict(host_group, digest=[*digest(recipe), token], detail=detail)
        if not agreed.same and plan_cache is not None:
            plan_cache.broken = True  # on every rank alike (the verdict is): all rebuild next
        agreed.raise_own_or_peer(error, WORDING)
        if not agreed.same:
            raise RankMismatchError(_disagreement(agreed.details or []))
    if rebuild:
        errors = _build_errors(recipe, params, names, where)
        plan = build_plan(params, names, recipe, host_group, errors, span_replicas)
    else:
        plan = plan_cache  # type: ignore[assignment]
    group_index = [where[id(p)][0] for p in params]
    if recipe == "muon":  # device mode: agreed on the host, then stepped on the device
        if verdict is not None:
            verdict.plan = plan
        groups = [optimizer.param_groups[gi] for gi in group_index]
        muon_step(optimizer, params, groups, plan, group, batched_ns, verdict)
    else:
        host = host_group if verdict is not None else None
        generic_step(optimizer, params, group_index, plan, group, host=host)
    return plan


def _agree_on_device(
    error: BaseException | None,
    recipe: str,
    token: int,
    rebuild: bool,
    plan_cache: WholeParamPlan | None,
    group: dist.ProcessGroup | None,
    verdict: DeviceVerdict,
) -> bool:
    """Muon's agreement under ``host_sync=False`` (``agree_on_device``). True: this rank keeps
    its plan, the agreement is folded into ``verdict`` (and this rank's own failure, which it
    raises after the exchanges). False: every rank rebuilds its plan at this step and agreed
    on the host, as a host-synced step does. Raises where a rank cannot step: every rank
    rebuilding and some failing or disagreeing (on every rank, as a host-synced step does),
    or this rank rebuilding while its peers keep their plan (after taking part in their
    exchanges)."""
    device = collective_device(group)
    bad, reduced = agree_on_device(error is not None, [*digest(recipe), token], group, device)
    if not rebuild:
        verdict.fold(bad)
        if error is not None:
            verdict.fail(error)
        return True
    # this rank builds its plan at this step: it reads the agreement (one host read)
    top = reduced.tolist()
    n = len(top) // 2
    kept = top[2]  # the largest token: a plan's digest where some rank keeps its plan
    if kept > REBUILD:
        verdict.fail(
            RankMismatchError(
                "this rank rebuilt its whole-param plan at this step while other ranks of the "
                "group kept theirs: its params or param groups changed, or invalidate_caches() "
                "was called, on some ranks only. Under OptimizerConfig(host_sync=False) the "
                "others cannot be told: their step is refused on the device (update_successful "
                "False, a NaN grad norm) and nothing was updated on any rank. Change params, "
                "groups and caches on every rank together, then call invalidate_caches() on "
                "every rank"
            )
        )
        if plan_cache is not None and plan_cache.digest == kept:
            muon_take_part(plan_cache, group, verdict)
        verdict.raise_own()
    if top[0] > 0 or any(top[i] != -top[n + i] for i in range(n)):
        # every rank rebuilds: each reads this, so all gather the failures and raise alike
        agreed = agree(error, group, detail=(recipe, True, REBUILD), always=True)
        agreed.raise_own_or_peer(error, WORDING)
        raise RankMismatchError(_disagreement(agreed.details or []))
    return False
