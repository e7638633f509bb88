"""Hyperparameter checks run before a step changes anything.

A NaN ``lr`` or ``eps`` (often an lr scheduler's bug) would turn every param of its group into
NaN; a string ``lr`` would fail halfway through the step, after counters moved. Each known
numeric key of every param group is checked for type, finiteness and range. Python numbers and
CPU tensors are read; an accelerator tensor (capturable or fused optimizers) is left alone,
since reading it would synchronise with the device.
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


def _check(where: str, value: Any, low: float, fix: str) -> None:
    try:
        x = _number(value)
    except TypeError:
        raise TypeError(
            f"{where} is {value!r} ({type(value).__name__}); it must be a number. {fix}"
        ) from None
    if x is not None and not (math.isfinite(x) and x >= low):
        raise ValueError(f"{where} is {x}: it must be a finite number >= {low:g}. {fix}")


def check_param_groups(groups: list[dict[str, Any]]) -> None:
    """Raise TypeError/ValueError naming the group and key of the first bad hyperparameter."""
    fix = "Fix the value (or the lr scheduler that set it); nothing was updated."
    for i, group in enumerate(groups):
        for key, low in _LOWEST.items():
            if key in group and group[key] is not None:
                _check(f"param_groups[{i}][{key!r}]", group[key], low, fix)
        betas = group.get("betas")
        if betas is not None:
            if not isinstance(betas, (tuple, list)):
                raise TypeError(
                    f"param_groups[{i}]['betas'] is {betas!r}; it must be a pair of "
                    f"numbers in [0, 1). {fix}"
                )
            for j, b in enumerate(betas):
                where = f"param_groups[{i}]['betas'][{j}]"
                _check(where, b, 0.0, fix)
                x = _number(b)
                if x is not None and not x < 1.0:
                    raise ValueError(f"{where} is {x}: it must be in [0, 1). {fix}")
