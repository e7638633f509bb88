"""How each base optimizer class is stepped on sharded params: its *update kind*.

``elementwise``: every element's update reads only that element of the param, grad and state
(torch's SGD, Adam, ...), so stepping local shards is exact. ``whole_param``: the update reads
the whole param (torch's Muon, Adafactor); it is computed on whole params (``_whole``).
``cross_param``: the update reads across params (LBFGS, Prodigy, the D-Adaptation family); the
only exact way would gather every param onto one rank, which is what FSDP exists to avoid, so
such classes are refused at construction, naming the class. ``kind_of`` decides, from
``OptimizerConfig.update_kinds``, then an ``mfsdp_update_kind`` attribute of the optimizer,
then torch's classes, then the registry of verified third-party classes (``_registry``); a
class it does not know takes the exact whole-param path, with one warning that says how to
find its kind (``classify_update``) and declare it. A declaration may be safer than what the
package knows of a class (elementwise < whole_param < cross_param), never faster.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from ._registry import REFUSED, REGISTRY

__all__ = ["CROSS_PARAM", "ELEMENTWISE", "KINDS", "WHOLE_PARAM", "check_update_kinds", "kind_of"]

ELEMENTWISE = "elementwise"
WHOLE_PARAM = "whole_param"
CROSS_PARAM = "cross_param"
KINDS = (ELEMENTWISE, WHOLE_PARAM, CROSS_PARAM)  # what a user may declare
_SAFETY = {ELEMENTWISE: 0, WHOLE_PARAM: 1, CROSS_PARAM: 2}

_O = torch.optim
_ELEMENTWISE_NAMES = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "ASGD",
)
_WHOLE_PARAM_NAMES = ("Muon", "Adafactor")
# apex's and Transformer Engine's FusedAdam: elementwise, known by module and name (optional)
_ACCELERATOR_ADAMS = (("apex.optimizers", "FusedAdam"), ("transformer_engine", "FusedAdam"))
_warned: set[type] = set()


def _torch_classes(names: tuple[str, ...]) -> tuple[type, ...]:
    return tuple(getattr(_O, n) for n in names if hasattr(_O, n))


def _unwrapped_step(cls: type) -> object:
    """``cls.step`` without torch's profiling wrapper (``Optimizer._patch_step_function`` sets
    a wrapped copy on the class of the first instance)."""
    step = cls.step  # type: ignore[attr-defined]
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


_REFUSED = {
    "LBFGS": (
        "its update reads across all params (one flat vector and line search over the whole "
        "model), which sharded params cannot give it exactly. Use it on unsharded params, or "
        "another optimizer."
    ),
    "SparseAdam": (
        "it needs sparse grads, and FSDP2 params have dense DTensor grads. Use torch.optim.Adam(W)."
    ),
}


def _refusal(cls: type) -> str | None:
    """Why ``cls`` (or the torch class it derives from) cannot be wrapped, or None."""
    for name, why in _REFUSED.items():
        base = getattr(_O, name, None)
        if base is not None and issubclass(cls, base):
            what = f"torch.optim.{name}" if cls is base else f"{cls.__qualname__} (a {name})"
            return f"{what} cannot be wrapped: {why}"
    return None


def _registered(cls: type) -> tuple[str, str] | None:
    """(kind, why) of ``cls`` or the nearest registered class it derives from."""
    for klass in cls.__mro__:
        entry = REGISTRY.get((klass.__module__, klass.__qualname__))
        if entry is not None:
            kind, why = entry
            # a subclass that overrides step() keeps a registered base's kind only if the base
            # reads across params (or is refused): overriding never makes it safe
            if (
                klass is cls
                or kind in (CROSS_PARAM, REFUSED)
                or _unwrapped_step(cls) is _unwrapped_step(klass)
            ):
                return kind, why
            return None
    return None


def known_kind(cls: type) -> str | None:
    """What the package knows of ``cls`` without a declaration: a kind, or None (unknown).
    Raises ValueError for refused classes."""
    refusal = _refusal(cls)
    if refusal is not None:
        raise ValueError(refusal)
    if cls in _torch_classes(_ELEMENTWISE_NAMES):
        return ELEMENTWISE
    if cls in _torch_classes(_WHOLE_PARAM_NAMES):
        return WHOLE_PARAM
    module = cls.__module__
    if any(module.startswith(m) and cls.__name__ == n for m, n in _ACCELERATOR_ADAMS):
        return ELEMENTWISE
    registered = _registered(cls)
    if registered is not None:
        if registered[0] == REFUSED:
            raise ValueError(f"{cls.__qualname__} cannot be wrapped: {registered[1]}.")
        return registered[0]
    # a subclass of a known class keeps its base's kind unless it overrides step()
    for base in _torch_classes(_ELEMENTWISE_NAMES + _WHOLE_PARAM_NAMES):
        if issubclass(cls, base) and _unwrapped_step(cls) is _unwrapped_step(base):
            return ELEMENTWISE if base.__name__ in _ELEMENTWISE_NAMES else WHOLE_PARAM
    return None


def _check_declared(cls: type, kind: object, where: str) -> str:
    """``kind`` validated for ``cls``: one of KINDS, and no faster than what is known."""
    if kind not in KINDS:
        raise ValueError(f"{where} is {kind!r}; it must be one of {list(KINDS)}")
    try:
        known = known_kind(cls)
    except ValueError as exc:
        raise ValueError(f"{where} is {kind!r}, but {exc}") from None
    if known is not None and _SAFETY[kind] < _SAFETY[known]:  # type: ignore[index]
        raise ValueError(
            f"{where} is {kind!r}, but {cls.__qualname__}'s update is {known!r}: stepping it as "
            f"{kind!r} would give a result that differs from the unsharded run. Drop the "
            "declaration (or declare a safer kind)."
        )
    return kind  # type: ignore[return-value]


def check_update_kinds(update_kinds: object) -> dict[type, str]:
    """``OptimizerConfig.update_kinds`` validated: ``{optimizer class: "elementwise" |
    "whole_param" | "cross_param"}``, none faster than the class's known kind."""
    if not isinstance(update_kinds, Mapping):
        raise TypeError(
            f"OptimizerConfig.update_kinds must be a mapping {{optimizer class: kind}}, got "
            f"{type(update_kinds).__name__}"
        )
    out: dict[type, str] = {}
    for cls, kind in update_kinds.items():
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"OptimizerConfig.update_kinds keys must be torch.optim.Optimizer classes, got "
                f"{cls!r}"
            )
        out[cls] = _check_declared(cls, kind, f"OptimizerConfig.update_kinds[{cls.__name__}]")
    return out


def _refuse_cross_param(cls: type, why: str) -> ValueError:
    return ValueError(
        f"{cls.__qualname__} cannot be wrapped: its update reads across params ({why}), so "
        "stepping each param's shards, or each param on one owner, differs from the unsharded "
        "run; the only exact way would gather every param onto one rank. Use it on unsharded "
        "params, or another optimizer."
    )


def kind_of(optimizer: torch.optim.Optimizer, declared: Mapping[type, str]) -> str:
    """The update kind of ``optimizer``'s class (see the module docstring); raises ValueError,
    naming the class, for classes that cannot be stepped exactly on sharded params."""
    cls = type(optimizer)
    if cls in declared:
        kind = declared[cls]
    else:
        own = getattr(optimizer, "mfsdp_update_kind", None)
        if own is not None:
            kind = _check_declared(cls, own, f"{cls.__name__}.mfsdp_update_kind")
        else:
            known = known_kind(cls)  # raises for refused classes
            if known is None:
                _warn_unknown(cls)
                return WHOLE_PARAM
            kind = known
            if kind == ELEMENTWISE and _registered(cls) is not None:
                changed = _options_changed(optimizer)
                if changed:
                    _warn_options(cls, changed)
                    return WHOLE_PARAM
    if kind == CROSS_PARAM:
        registered = _registered(cls)
        raise _refuse_cross_param(cls, registered[1] if registered else "declared so")
    return kind


# options of third-party classes that keep an elementwise update elementwise; any other
# constructor option changed from its default (AdaNorm's ``adanorm``, gradient centralisation,
# a projection ``rank``, ...) may read whole params, which the registry's evidence did not cover
_TUNING = frozenset(
    (
        "lr",
        "weight_decay",
        "betas",
        "eps",
        "momentum",
        "dampening",
        "nesterov",
        "foreach",
        "maximize",
        "weight_decouple",
        "fixed_decay",
        "amsgrad",
        "differentiable",
        "capturable",
        "fused",
        "params",
        # written by the class's step or by an lr scheduler, not options
        "step",
        "initial_lr",
    )
)


def _options_changed(optimizer: torch.optim.Optimizer) -> list[str]:
    """The constructor options of ``optimizer`` that differ from the class's defaults, outside
    ``_TUNING`` (read from its groups and ``defaults``)."""
    import inspect

    try:
        sig = inspect.signature(type(optimizer).__init__)
    except (TypeError, ValueError):
        return ["<signature unreadable>"]
    # an option the signature does not name (taken through **kwargs, e.g. AdaBelief's adanorm),
    # unless a fresh instance holds the same value (a value the class sets itself, such as
    # schedule-free's train_mode or VSGD's pa2)
    named = set(sig.parameters)
    unnamed = sorted({k for g in optimizer.param_groups for k in g if k not in named} - _TUNING)
    fresh = _fresh_group(optimizer, sig) if unnamed else {}
    changed = [
        k
        for k in unnamed
        if k not in fresh or not all(_equal(g.get(k), fresh[k]) for g in optimizer.param_groups)
    ]
    for name, param in sig.parameters.items():
        if name in _TUNING or param.default is inspect.Parameter.empty:
            continue
        values = [g[name] for g in optimizer.param_groups if name in g]
        if name in optimizer.defaults:
            values.append(optimizer.defaults[name])
        elif not values:
            values = [getattr(optimizer, name)] if hasattr(optimizer, name) else []
        if any(not _equal(v, param.default) for v in values):
            changed.append(name)
    return changed


def _equal(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain ==
        return False


def _fresh_group(optimizer: torch.optim.Optimizer, sig) -> dict:
    """The group values of a fresh instance of ``optimizer``'s class on one dummy param with
    its default options (the required ones taken from ``optimizer``); {} where it cannot be
    built. The global random generators are left as they were."""
    import inspect
    import random

    kwargs = {}
    for name, param in sig.parameters.items():
        if name in ("self", "params") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is inspect.Parameter.empty:
            source = optimizer.param_groups[0]
            if name not in source:
                source = optimizer.defaults
            if name not in source:
                return {}
            kwargs[name] = source[name]
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = type(optimizer)([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        return {k: v for k, v in fresh.param_groups[0].items() if k != "params"}
    except Exception:  # noqa: BLE001 - not constructible so: every unnamed value counts
        return {}
    finally:
        random.setstate(state)


def _warn_options(cls: type, changed: list[str]) -> None:
    warnings.warn(
        f"{cls.__qualname__} is registered as elementwise with its default options; with "
        f"{', '.join(changed)} changed its update may read whole params, so mfsdp_optim steps "
        "it on whole params (exact, with one exchange per step). If it stays elementwise, "
        f"check with `python -m mfsdp_optim.optim classify` and declare it: "
        f"OptimizerConfig(update_kinds={{{cls.__name__}: 'elementwise'}}).",
        UserWarning,
        stacklevel=5,
    )


def _warn_unknown(cls: type) -> None:
    if cls in _warned:
        return
    _warned.add(cls)
    warnings.warn(
        f"mfsdp_optim does not know whether {cls.__qualname__}'s update reads whole params, so "
        "it steps each param on the whole param (exact, with one exchange per step). Find its "
        f"kind with `python -m mfsdp_optim.optim classify {cls.__module__}:{cls.__qualname__}`; "
        "if every element's update reads only that element, declare it: "
        f"OptimizerConfig(update_kinds={{{cls.__name__}: 'elementwise'}}) for the local-shard "
        "step.",
        UserWarning,
        stacklevel=5,
    )
