"""Hyperparameter checks run before a step changes anything.

A NaN ``lr`` or ``eps`` (often an lr scheduler's bug) would turn every param of its group into
NaN; a string ``lr`` would fail halfway through the step, after counters moved. Each key of a
param group is checked against the type of the optimizer class's own default for it (a number,
a flag, a tuple such as ``betas`` or Adafactor's ``eps=(None, 1e-3)``), numbers also for
finiteness and the ranges below. Python numbers and CPU tensors are read; an accelerator
tensor (capturable or fused optimizers) is left alone, since reading it would synchronise.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["check_param_groups"]

# key -> the lowest value allowed, for the scalar hyperparameters of torch's optimizers
_LOWEST: dict[str, float] = {
    "lr": 0.0,
    "weight_decay": 0.0,
    "eps": 0.0,
    "momentum": 0.0,
    "dampening": 0.0,
    "alpha": 0.0,
    "lr_decay": 0.0,
    "initial_accumulator_value": 0.0,
    "rho": 0.0,
    "lambd": 0.0,
}


def _number(value: Any) -> float | None:
    """``value`` as a float, None for a device tensor; raises TypeError for a non-number."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            return None
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(type(value).__name__)
    return float(value)


def _check(where: str, value: Any, low: float, fix: str, infinite: bool = False) -> None:
    """``infinite``: the class's own default for this key is infinite (Prodigy's
    ``growth_rate``), so an infinite value is one it accepts; NaN never is."""
    try:
        x = _number(value)
    except TypeError:
        raise TypeError(
            f"{where} is {value!r} ({type(value).__name__}); it must be a number. {fix}"
        ) from None
    if x is not None and infinite and math.isinf(x) and x >= low:
        return
    if x is not None and not (math.isfinite(x) and x >= low):
        bound = f" >= {low:g}" if math.isfinite(low) else ""
        raise ValueError(f"{where} is {x}: it must be a finite number{bound}. {fix}")


def _check_like(where: str, value: Any, default: Any, low: float, fix: str) -> None:
    """``value`` against the class's ``default`` for its key: same kind, numbers in range."""
    if default is None or value is None:
        return  # the class takes None here (e.g. an optional eps or foreach): nothing to compare
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(
                f"{where} is {value!r} ({type(value).__name__}); it must be a bool. {fix}"
            )
        return
    if isinstance(default, (numbers.Real, torch.Tensor)):
        _check(where, value, low, fix, infinite=_is_inf(default))
        return
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(default):
            raise TypeError(
                f"{where} is {value!r}; it must be a tuple of {len(default)} like the default "
                f"{default!r}. {fix}"
            )
        for j, (v, d) in enumerate(zip(value, default, strict=True)):
            _check_like(f"{where}[{j}]", v, d, low, fix)
        return
    if isinstance(default, str) and not isinstance(value, str):
        raise TypeError(f"{where} is {value!r} ({type(value).__name__}); it must be a str. {fix}")


def _is_inf(default: Any) -> bool:
    try:
        x = _number(default)
    except TypeError:
        return False
    return x is not None and math.isinf(x)


def _beta_limit(defaults: dict[str, Any], j: int) -> float | None:
    """The largest beta allowed at index ``j``: None (below 1), or the class's own default
    where that is 1 or more (PNM's ``betas=(0.9, 1.0)``), inclusive."""
    default = defaults.get("betas")
    if isinstance(default, (tuple, list)) and j < len(default):
        try:
            x = _number(default[j])
        except TypeError:
            return None
        if x is not None and x >= 1.0:
            return x
    return None


def check_param_groups(
    groups: list[dict[str, Any]], defaults: dict[str, Any] | None = None
) -> None:
    """Raise TypeError/ValueError naming the group and key of the first bad hyperparameter.

    Args:
        groups: The optimizer's param groups.
        defaults: The optimizer's ``defaults``: each key's type is read from its default there;
            the keys of ``_LOWEST`` are checked as numbers when the class has no default."""
    fix = "Fix the value (or the lr scheduler that set it); nothing was updated."
    defaults = defaults or {}
    for i, group in enumerate(groups):
        for key, value in group.items():
            if key == "params" or value is None:
                continue
            where = f"param_groups[{i}][{key!r}]"
            low = _LOWEST.get(key, -math.inf)
            if key in defaults:
                _check_like(where, value, defaults[key], low, fix)
            elif key in _LOWEST:
                _check(where, value, low, fix)
        betas = group.get("betas")
        if betas is not None:
            if not isinstance(betas, (tuple, list)):
                raise TypeError(
                    f"param_groups[{i}]['betas'] is {betas!r}; it must be a pair of "
                    f"numbers in [0, 1). {fix}"
                )
            for j, b in enumerate(betas):
                if b is None:
                    continue  # an optional beta (e.g. CAME's, Adafactor-style classes')
                where = f"param_groups[{i}]['betas'][{j}]"
                _check(where, b, 0.0, fix)
                x = _number(b)
                limit = _beta_limit(defaults, j)
                if x is not None and not (x < 1.0 or (limit is not None and x <= limit)):
                    span = "[0, 1)" if limit is None else f"[0, {limit:g}] (the class's default)"
                    raise ValueError(f"{where} is {x}: it must be in {span}. {fix}")
