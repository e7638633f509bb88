"""How one optimizer state value of one parameter appears in the fsdp_dtensor layout.

Map: ``classify`` a value as an ``EntryLayout`` of kind ``"t"`` (parameter-shaped: a DTensor in the
param's layout, or a local-shard-shaped tensor that ``wrap`` turns into one, no copy), ``"s"``
(a 0-d plain tensor such as Adam's ``step``), ``"r"`` (a DTensor of its own global shape and
placements on the param's mesh, e.g. Adafactor's factors: saved as it is, its slot value
``(shape, placements)``) or ``"n"`` (a plain Python value); anything else raises
``StateLayoutError`` naming the param and key. ``placeholder`` the stand-in a rank without
state emits. The kinds, and why others are refused: docs/concepts.md, "Inside the checkpoint
layer".
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .._infra.placement import in_layout_of
from ._values import dtype_from_name, dtype_name

__all__ = [
    "OWN_LAYOUT",
    "PARAM_SHAPED",
    "PLAIN",
    "SCALAR",
    "EntryLayout",
    "StateLayoutError",
    "classify",
    "own_layout",
    "placeholder",
    "wrap",
]

_PLAIN = (bool, int, float, str, type(None))

# the kinds of EntryLayout (one letter: they travel in every rank's keyspace description)
PARAM_SHAPED = "t"  # a DTensor in the param's layout (or a local-shard-shaped tensor)
SCALAR = "s"  # a 0-d plain tensor, such as Adam's step
OWN_LAYOUT = "r"  # a DTensor of its own global shape on the param's mesh (Adafactor's factors)
PLAIN = "n"  # a plain Python value


class StateLayoutError(ValueError):
    """A state value whose layout cannot be derived from its parameter's."""


class EntryLayout(NamedTuple):
    """How one state entry (one key of one parameter's optimizer state) is laid out in the
    checkpoint, as a rank knows it: its kind (``PARAM_SHAPED``, ``SCALAR``, ``OWN_LAYOUT`` or
    ``PLAIN``), dtype name, and value (a scalar's, a plain value, or an own layout's ``(shape,
    placements)``). Not ``optim._slots.Slot``, the wrapper's per-param cache."""

    kind: str
    dtype: str | None
    value: Any


def local_shape(param: DTensor) -> torch.Size:
    return param._local_tensor.shape


def own_layout(value: DTensor) -> tuple[tuple[int, ...], tuple]:
    """The slot value of an ``"r"`` state DTensor: its global shape and placements."""
    return tuple(value.shape), tuple(value.placements)


def classify(fqn: str, key: str, value: Any, param: DTensor) -> EntryLayout:
    """The kind of ``value``; the value of an ``"s"`` slot is filled in later, batched."""
    if isinstance(value, DTensor):
        if value.shape == param.shape:
            return EntryLayout(PARAM_SHAPED, dtype_name(value.dtype), None)
        where = f"state {fqn!r}[{key!r}] (a DTensor of global shape {tuple(value.shape)})"
        if value.device_mesh != param.device_mesh:
            raise StateLayoutError(
                f"{where} lives on {value.device_mesh}, its parameter on {param.device_mesh}: "
                "state not shaped like its parameter must live on the parameter's mesh"
            )
        if any(p.is_partial() for p in value.placements):
            raise StateLayoutError(
                f"{where} has a Partial placement {tuple(value.placements)}: reduce it before "
                "saving (its local values are pending addends, not pieces of the state)"
            )
        return EntryLayout(OWN_LAYOUT, dtype_name(value.dtype), own_layout(value))
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and (param.dim() > 0 or key == "step"):
            return EntryLayout(SCALAR, dtype_name(value.dtype), None)
        if value.shape == local_shape(param):
            return EntryLayout(PARAM_SHAPED, dtype_name(value.dtype), None)
        raise StateLayoutError(
            f"state {fqn!r}[{key!r}] is a plain tensor of shape {tuple(value.shape)}, neither the "
            f"local shard's shape {tuple(local_shape(param))} nor a 0-d scalar: its layout "
            "across ranks is unknown, so it cannot be checkpointed as a resharding DTensor"
        )
    if isinstance(value, _PLAIN):
        return EntryLayout(PLAIN, None, value)
    raise StateLayoutError(
        f"state {fqn!r}[{key!r}] is a {type(value).__name__}; expected a tensor or a plain value"
    )


def wrap(value: torch.Tensor, param: DTensor) -> DTensor:
    """A parameter-shaped state tensor as a DTensor in the parameter's layout, sharing storage."""
    if isinstance(value, DTensor):
        return value
    return in_layout_of(value, param)


def placeholder(slot: EntryLayout, param: DTensor) -> Any:
    """The value a rank without state emits for ``slot``: zeros in the parameter's layout (empty
    when its local shard is empty), zeros in an ``"r"`` slot's own shape and placements on the
    parameter's mesh, or the owners' scalar value."""
    if slot.kind == PARAM_SHAPED:
        assert slot.dtype is not None  # classify() names the dtype of every tensor slot
        local = torch.zeros(
            local_shape(param), dtype=dtype_from_name(slot.dtype), device=param._local_tensor.device
        )
        return wrap(local, param)
    if slot.kind == OWN_LAYOUT:
        assert slot.dtype is not None
        shape, placements = slot.value
        mesh = param.device_mesh
        local_size, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = torch.zeros(
            local_size, dtype=dtype_from_name(slot.dtype), device=param._local_tensor.device
        )
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    if slot.kind == SCALAR:
        assert slot.dtype is not None  # classify() names the dtype of every tensor slot
        return torch.tensor(slot.value, dtype=dtype_from_name(slot.dtype))
    return slot.value
