"""How one optimizer state value of one parameter appears in the fsdp_dtensor layout.

Map: ``classify`` a value as a ``Slot`` of kind ``"t"`` (parameter-shaped: a DTensor in the
param's layout, or a local-shard-shaped tensor that ``wrap`` turns into one, no copy), ``"s"``
(a 0-d plain tensor such as Adam's ``step``) or ``"n"`` (a plain Python value); anything else
raises ``StateLayoutError`` naming the param and key. ``placeholder`` the empty-local stand-in
a rank without state emits. The kinds, and why others are refused: docs/concepts.md, "Inside
the checkpoint layer".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .._infra.placement import in_layout_of
from ._values import dtype_from_name, dtype_name

__all__ = ["StateLayoutError", "Slot", "classify", "placeholder", "wrap"]

_PLAIN = (bool, int, float, str, type(None))


class StateLayoutError(ValueError):
    """A state value whose layout cannot be derived from its parameter's."""


class Slot(NamedTuple):
    """What a rank knows about one state key of one parameter: kind, dtype name, scalar value."""

    kind: str
    dtype: str | None
    value: Any


def local_shape(param: DTensor) -> torch.Size:
    return param._local_tensor.shape


def classify(fqn: str, key: str, value: Any, param: DTensor) -> Slot:
    """The kind of ``value``; the value of an ``"s"`` slot is filled in later, batched."""
    if isinstance(value, DTensor):
        if value.shape != param.shape:
            raise StateLayoutError(
                f"state {fqn!r}[{key!r}] is a DTensor of global shape {tuple(value.shape)}, "
                f"its parameter's is {tuple(param.shape)}: only parameter-shaped state reshards"
            )
        return Slot("t", dtype_name(value.dtype), None)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and (param.dim() > 0 or key == "step"):
            return Slot("s", dtype_name(value.dtype), None)
        if value.shape == local_shape(param):
            return Slot("t", dtype_name(value.dtype), None)
        raise StateLayoutError(
            f"state {fqn!r}[{key!r}] is a plain tensor of shape {tuple(value.shape)}, neither the "
            f"local shard's shape {tuple(local_shape(param))} nor a 0-d scalar: its layout "
            "across ranks is unknown, so it cannot be checkpointed as a resharding DTensor"
        )
    if isinstance(value, _PLAIN):
        return Slot("n", None, value)
    raise StateLayoutError(
        f"state {fqn!r}[{key!r}] is a {type(value).__name__}; expected a tensor or a plain value"
    )


def wrap(value: torch.Tensor, param: DTensor) -> DTensor:
    """A parameter-shaped state tensor as a DTensor in the parameter's layout, sharing storage."""
    if isinstance(value, DTensor):
        return value
    return in_layout_of(value, param)


def placeholder(slot: Slot, param: DTensor) -> Any:
    """The value a rank without state emits for ``slot``: zeros in the parameter's layout (empty
    when its local shard is empty), or the owners' scalar value."""
    if slot.kind == "t":
        assert slot.dtype is not None  # classify() names the dtype of every tensor slot
        local = torch.zeros(
            local_shape(param), dtype=dtype_from_name(slot.dtype), device=param._local_tensor.device
        )
        return wrap(local, param)
    if slot.kind == "s":
        assert slot.dtype is not None  # classify() names the dtype of every tensor slot
        return torch.tensor(slot.value, dtype=dtype_from_name(slot.dtype))
    return slot.value
