"""What torch's Muon and Adafactor steps would reject, checked before a whole-param step.

The generic hyperparameter check (``optim._hyper``) reads each value's type from the class's
default; these are the values whose default does not tell the rule: Muon's ``ns_steps`` (an
integer below 100, or Newton-Schulz raises on the owner) and ``ns_coefficients`` (three
numbers), Adafactor's ``eps`` pair (``eps1`` may be None, ``eps2`` must be a number). A class
that overrides ``step()`` is not checked here: its own rules may differ. ``partial_grad_message``
is what an owner raises when a param's grad is None on some ranks of its mesh only (Muon and the
generic path alike).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

__all__ = ["check_whole_hyperparameters", "partial_grad_message"]

_FIX = "Fix the value (or the lr scheduler that set it); nothing was updated."


def _unwrapped(step: Any) -> Any:
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def _steps_like(optimizer: torch.optim.Optimizer, name: str) -> bool:
    cls = getattr(torch.optim, name, None)
    return (
        cls is not None
        and isinstance(optimizer, cls)
        and _unwrapped(type(optimizer).step) is _unwrapped(cls.step)
    )


def _number(where: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        if value.device.type != "cpu":
            return  # reading it would synchronise; torch's step reads it as it is
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = type(value).__name__
        raise TypeError(f"{where} is {value!r} ({kind}); it must be a number. {_FIX}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{where} is {value}: it must be a finite number. {_FIX}")


def _check_muon(i: int, group: dict[str, Any]) -> None:
    where = f"param_groups[{i}]['ns_steps']"
    steps: Any = group.get("ns_steps")
    try:
        n = operator.index(steps)  # what range() takes
    except TypeError:
        raise TypeError(
            f"{where} is {steps!r} ({type(steps).__name__}); it must be an integer (the number "
            f"of Newton-Schulz iterations). {_FIX}"
        ) from None
    if n >= 100:
        raise ValueError(
            f"{where} is {n}: torch's Muon takes fewer than 100 Newton-Schulz iterations. {_FIX}"
        )
    coefficients: Any = group.get("ns_coefficients")
    where = f"param_groups[{i}]['ns_coefficients']"
    try:
        values = list(coefficients)
    except TypeError:
        values = None
    if values is None or len(values) != 3:
        raise ValueError(f"{where} is {coefficients!r}: it must be 3 numbers (a, b, c). {_FIX}")
    for j, v in enumerate(values):
        _number(f"{where}[{j}]", v)
    _number(f"param_groups[{i}]['eps']", group.get("eps"))


def _check_adafactor(i: int, group: dict[str, Any]) -> None:
    where = f"param_groups[{i}]['eps']"
    eps = group.get("eps")
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise TypeError(
            f"{where} is {eps!r}; torch's Adafactor takes a pair (eps1, eps2), eps1 a number or "
            f"None. {_FIX}"
        )
    _number(f"{where}[0]", eps[0], none_ok=True)
    _number(f"{where}[1]", eps[1])


def check_whole_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Raise TypeError/ValueError naming the group and key of the first value torch's Muon or
    Adafactor step would reject mid-step (other classes: nothing to check here)."""
    if _steps_like(optimizer, "Muon"):
        check = _check_muon
    elif _steps_like(optimizer, "Adafactor"):
        check = _check_adafactor
    else:
        return
    for i, group in enumerate(optimizer.param_groups):
        check(i, group)


def partial_grad_message(name: str, have: list[int], lack: list[int]) -> str:
    """The owner's error for param ``name`` whose grad is on ranks ``have`` of its mesh (its
    shard group, and the other replica groups where its unit spans them) and None on ranks
    ``lack``."""
    return (
        f"param {name!r}: its grad is None on ranks {lack} but not on ranks {have} of its "
        "mesh, so its whole-param update cannot be computed: give it a grad on every "
        "rank of its mesh or on none (e.g. zero_grad(set_to_none=True) on every rank, a "
        "param used on some ranks only); nothing was updated on any rank"
    )
