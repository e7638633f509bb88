"""``classify_update``: find an optimizer class's update kind by stepping it, with evidence.

Three references run in one process over the same seeded params and grads: one instance over
all params (what the user runs), one instance per param, and the first again under another
random seed. The class *draws random numbers* when the two seeds differ, or when its ``step()``
moves a global random generator (torch's CPU one, Python's, numpy's) even where the values
drawn happen not to change the result: the stream is shared by every param, so what one param
draws depends on the params stepped before it, and a rank that steps only some params draws
other values (the sharded run cannot be judged against one unsharded run then, and the package
refuses such a class); it *reads across params* when one instance differs
from one per param. Then, on CPU gloo ranks, the class is stepped under the wrapper on each
layout (1-D uneven with an empty shard, HSDP 2x2, 2-D), first on local shards
(``"elementwise"``), then on whole params (``"whole_param"``), and each result is compared with
the one-instance reference fed the very grads the sharded run got (``full_tensor()``).

The kind returned is the fastest one whose evidence is exact on every layout and every step;
a class that reads across params or draws random numbers is never given a faster kind than
the evidence shows. Nothing here changes what ``kind_of`` decides: a declaration stays the
user's (``OptimizerConfig.update_kinds``), and the package never moves a class to the faster
path on its own.
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LAYOUTS", "Classification", "classify_update", "load_class", "trial"]

# name -> (mesh shape, placements ("S0", "S1", "R") per mesh dim, param shapes); 4 ranks each
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[tuple[int, ...], ...]]] = {
    # rows 2, 2, 1, 0 and 1, 1, 0, 0: uneven shards and an empty one
    "1d-uneven-empty": ((4,), ("S0",), ((5, 3), (2, 6), (9, 4))),
    "hsdp-2x2": ((2, 2), ("R", "S0"), ((6, 4), (3, 5))),
    "2d": ((2, 2), ("S0", "S1"), ((6, 5), (4, 4))),
}
DEFAULT_STEPS = 8  # past the warm-ups of the classes tried (a lookahead of 5, ...)
_WORLD = 4


def load_class(target: str | type) -> type:
    """``"package.module:Class"`` (or the class itself) as the class."""
    if isinstance(target, type):
        return target
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"{target!r}: expected 'package.module:Class'")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise TypeError(f"{target!r} is not a torch.optim.Optimizer class")
    return obj


def _target(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _values(seed: int, shape: tuple[int, ...], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1_000_003 * seed + 7919 * step + 17)
    return torch.randn(shape, generator=gen)


def _params_and_grads(
    layout: str, steps: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    shapes = LAYOUTS[layout][2]
    params = [_values(i, s, 0) for i, s in enumerate(shapes)]
    grads = [[_values(i, s, t + 1) * 0.1 for i, s in enumerate(shapes)] for t in range(steps)]
    return params, grads


def _step_reference(
    cls: type,
    kwargs: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor]],
    *,
    per_param: bool = False,
    seed: int = 0,
    draws: list[bool] | None = None,
) -> list[torch.Tensor]:
    """The class on unsharded copies of ``params``, fed ``grads[t]`` at step t; appends to
    ``draws`` whether each ``step()`` moved a global random generator."""
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opts = [cls([p], **kwargs) for p in ps] if per_param else [cls(ps, **kwargs)]
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.detach().clone()
        for o in opts:
            before = _generators()
            o.step()
            if draws is not None:
                draws.append(_generators() != before)
    return [p.detach() for p in ps]


def _generators() -> list[object]:
    """The global random generators' states (torch's CPU one, Python's, numpy's if present),
    comparable with ``==``."""
    import random
    import sys

    out: list[object] = [torch.get_rng_state().tolist(), random.getstate()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, *rest = np.random.get_state()
        out.append((kind, keys.tolist(), *rest))
    return out


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.numel():
            d = (x.double() - y.double()).abs()
            d = torch.where(torch.isnan(x) & torch.isnan(y), torch.zeros_like(d), d)
            worst = max(worst, float(d.nan_to_num(nan=math.inf).max()))
    return worst


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def references(cls: type, kwargs: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Single-process evidence on the 1-D layout's params: whether the class runs at all,
    draws random numbers, or reads across params."""
    params, grads = _params_and_grads("1d-uneven-empty", steps)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draws: list[bool] = []
            one = _step_reference(cls, kwargs, params, grads, draws=draws)
            other_seed = _step_reference(cls, kwargs, params, grads, seed=1)
            each = _step_reference(cls, kwargs, params, grads, per_param=True)
    except Exception as exc:  # noqa: BLE001 - reported as evidence
        return {"runs": False, "error": _short(exc)}
    return {
        "runs": True,
        "random": not _same(one, other_seed) or any(draws),
        "cross_param": not _same(one, each),
        "cross_param_diff": _max_diff(one, each),
    }


def _layout_mesh(layout: str):
    """The DeviceMesh of ``layout`` over the 4 CPU ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", LAYOUTS[layout][0])


def trial(
    target: str | type,
    kwargs: Mapping[str, Any],
    layout: str,
    steps: int,
    kind: str | None,
    seed: int = 0,
) -> dict[str, Any]:
    """Rank side (every rank of a 4-rank gloo world): the class under the wrapper on ``layout``
    for ``steps`` steps, ``kind`` declared (None: as the package treats it), against the class
    on the unsharded params fed the ``full_tensor()`` of the sharded grads. Returns
    ``{"refused": msg}`` (raised at construction), ``{"error": msg}`` (raised in a step; every
    rank raises), or ``{"exact": bool, "max_diff": float, "kind": kind used}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from .._config import OptimizerConfig
    from .._optimizer import FullyShardedOptimizer
    from ._kind_of import kind_of

    cls = load_class(target)
    mesh_shape, placement_names, _ = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Replicate() if n == "R" else Shard(int(n[1])) for n in placement_names]
    params0, grads = _params_and_grads(layout, steps)
    params = [
        torch.nn.Parameter(distribute_tensor(p.clone(), mesh, placements, src_data_rank=None))
        for p in params0
    ]
    seen: list[list[torch.Tensor]] = []

    def agreed(failure: str | None) -> str | None:
        # every rank learns whether any raised, before the next collective: a rank that raised
        # alone must not leave the others waiting (the package's own fault handling is tested
        # elsewhere; this keeps a trial of a class that fails on some ranks from hanging)
        flag = torch.tensor([0 if failure is None else 1])
        dist.all_reduce(flag)
        return failure or ("another rank raised" if int(flag) else None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failure: str | None = None
        try:
            torch.manual_seed(seed)
            config = OptimizerConfig(update_kinds={cls: kind} if kind else {})
            opt = FullyShardedOptimizer(cls(params, **kwargs), config)
        except Exception as exc:  # noqa: BLE001 - reported
            failure = _short(exc)
        if agreed(failure) is not None:
            return {"refused": failure or "another rank refused it"}
        # the kind the wrapper's engine took: decided from the class and the config alone, and
        # nothing changed since the constructor asked (its warnings are ignored here too)
        used = kind_of(opt.optimizer, config.update_kinds)
        for step_grads in grads:
            try:
                for p, g in zip(params, step_grads, strict=True):
                    p.grad = distribute_tensor(g.clone(), mesh, placements, src_data_rank=None)
                seen.append([p.grad.full_tensor() for p in params])  # type: ignore[union-attr]
                ok, _, _ = opt.step()
                if not ok:
                    raise RuntimeError("the step was skipped")
                opt.zero_grad()
            except Exception as exc:  # noqa: BLE001 - reported
                failure = _short(exc)
            failure = agreed(failure)
            if failure is not None:
                return {"error": failure, "kind": used}
    got = [p.detach().full_tensor() for p in params]  # type: ignore[attr-defined]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _step_reference(cls, kwargs, params0, seen, seed=seed)
    except Exception as exc:  # noqa: BLE001 - the unsharded class itself fails
        return {"error": "unsharded: " + _short(exc), "kind": used}
    return {"exact": _same(got, want), "max_diff": _max_diff(got, want), "kind": used}


@dataclass
class Classification:
    """What ``classify_update`` found; ``str()`` of it is the report the CLI prints.

    Attributes:
        target: The class as ``"package.module:Class"``.
        kind: ``"elementwise"``, ``"whole_param"`` or ``"cross_param"``: the fastest kind the
            evidence allows; None when the class does not run with these arguments.
        treated: The kind the package steps the class as today (with ``declared``), None
            where it refuses the class.
        evidence: The single-process references and each sharded run, per kind and layout.
    """

    target: str
    kind: str | None
    treated: str | None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        """Whether the package's treatment is no faster than the evidence allows."""
        order = {"elementwise": 0, "whole_param": 1, "cross_param": 2}
        if self.kind is None or self.treated is None:
            return True
        return order[self.treated] >= order[self.kind]

    def __str__(self) -> str:
        lines = [f"{self.target}: {self.kind or 'does not run with these arguments'}"]
        lines.append(f"  the package treats it as: {self.treated or 'refused'}")
        ref = self.evidence.get("references", {})
        if not ref.get("runs", True):
            lines.append(f"  unsharded: {ref.get('error')}")
        else:
            lines.append(
                f"  unsharded: draws random numbers: {ref.get('random')}; reads across params: "
                f"{ref.get('cross_param')} (one instance vs one per param: max |diff| "
                f"{ref.get('cross_param_diff', 0.0):.3g})"
            )
        for kind in ("elementwise", "whole_param"):
            for layout, r in self.evidence.get(kind, {}).items():
                if "exact" in r:
                    what = "exact" if r["exact"] else f"differs (max |diff| {r['max_diff']:.3g})"
                else:
                    what = r.get("refused") or r.get("error")
                lines.append(f"  {kind} on {layout}: {what}")
        if not self.safe:
            lines.append(
                f"  WRONG: the package steps it as {self.treated}, but the evidence says "
                f"{self.kind}; fix the declaration"
            )
        return "\n".join(lines)


def _treated(cls: type, declared: Mapping[type, str]) -> str | None:
    """The kind ``kind_of`` gives ``cls`` (None: refused), without building it or warning."""
    from ._kind_of import CROSS_PARAM, WHOLE_PARAM, known_kind

    try:
        kind = declared.get(cls) or getattr(cls, "mfsdp_update_kind", None) or known_kind(cls)
    except ValueError:
        return None
    if kind is None:
        return WHOLE_PARAM  # unknown: the exact whole-param path, with a warning
    return None if kind == CROSS_PARAM else kind


def decide(
    refs: Mapping[str, Any], runs: Mapping[str, Mapping[str, Mapping[str, Any]]]
) -> str | None:
    """The kind the evidence allows (see the module docstring)."""
    if not refs.get("runs", False):
        return None
    if refs.get("random") or refs.get("cross_param"):
        return "cross_param"
    for kind in ("elementwise", "whole_param"):
        results = runs.get(kind, {})
        if results and all(r.get("exact") for r in results.values()):
            return kind
    return "cross_param"


def _rank_main(rank: int, init: str, target: str, kwargs: dict, steps: int, layouts, out: str):
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=_WORLD)
    results: dict[str, dict[str, Any]] = {}
    try:
        for kind in ("elementwise", "whole_param"):
            results[kind] = {}
            for layout in layouts:
                try:
                    results[kind][layout] = trial(target, kwargs, layout, steps, kind)
                except Exception:  # noqa: BLE001 - reported
                    results[kind][layout] = {"error": traceback.format_exc(limit=2)}
    finally:
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(results, f)
        dist.destroy_process_group()


def classify_update(
    cls: type | str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    layouts: Sequence[str] = tuple(LAYOUTS),
    declared: Mapping[type, str] | None = None,
) -> Classification:
    """Step ``cls(params, **kwargs)`` sharded and unsharded and return its update kind with
    the evidence (see the module docstring). Spawns 4 CPU gloo processes (tens of seconds).

    Args:
        cls: An optimizer class, or ``"package.module:Class"``.
        kwargs: The constructor's arguments besides params (e.g. ``{"lr": 1e-3}``).
        steps: Steps per run; enough to pass the class's warm-up (lookahead, switching, ...).
        layouts: Names from ``LAYOUTS``.
        declared: ``OptimizerConfig.update_kinds`` to judge ``treated`` with.

    Returns:
        A [Classification][mfsdp_optim.optim.Classification]; ``safe`` is False when the
        package (or ``declared``) would step the class faster than the evidence allows.
    """
    import pickle

    import torch.multiprocessing as mp

    klass = load_class(cls)
    kwargs = dict(kwargs or {})
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    refs = references(klass, kwargs, steps)
    evidence: dict[str, Any] = {"references": refs, "steps": steps}
    # a class that reads across params or draws random numbers is cross_param whatever the
    # sharded runs show: they are skipped
    if refs.get("runs") and not (refs.get("random") or refs.get("cross_param")):
        with tempfile.TemporaryDirectory(prefix="mfsdp_classify_") as tmp:
            out = os.path.join(tmp, "out.pkl")
            mp.start_processes(
                _rank_main,
                args=(
                    os.path.join(tmp, "init"),
                    _target(klass),
                    kwargs,
                    steps,
                    tuple(layouts),
                    out,
                ),
                nprocs=_WORLD,
                start_method="spawn",
            )
            with open(out, "rb") as f:
                evidence.update(pickle.load(f))
    return _classification(klass, kwargs, evidence, declared)


def _classification(
    klass: type,
    kwargs: Mapping[str, Any],
    evidence: dict[str, Any],
    declared: Mapping[type, str] | None,
) -> Classification:
    kind = decide(evidence["references"], evidence)
    return Classification(_target(klass), kind, _treated(klass, declared or {}), evidence)


def classify_with(
    run: Callable[[str, Mapping[str, Any], str, int, str], dict[str, Any]],
    cls: type | str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    layouts: Sequence[str] = tuple(LAYOUTS),
    declared: Mapping[type, str] | None = None,
) -> Classification:
    """``classify_update`` with the sharded runs made by ``run(target, kwargs, layout, steps,
    kind)`` (rank 0's ``trial`` result), e.g. on ranks that already exist (the test suite's)."""
    klass = load_class(cls)
    kwargs = dict(kwargs or {})
    refs = references(klass, kwargs, steps)
    evidence: dict[str, Any] = {"references": refs, "steps": steps}
    if refs.get("runs") and not (refs.get("random") or refs.get("cross_param")):
        for kind in ("elementwise", "whole_param"):
            evidence[kind] = {n: run(_target(klass), kwargs, n, steps, kind) for n in layouts}
            if all(r.get("exact") for r in evidence[kind].values()):
                break
    return _classification(klass, kwargs, evidence, declared)
