"""State values: how each one is stored, and plain values as checkpoint-safe Python data.

A leaf of the checkpoint layer: it imports nothing else of the package, and the build's stages
(``_build_sharded_state_dict``'s map) and the load call it freely.

Map: ``classify`` one optimizer state value of one param as an ``EntryLayout`` of kind
``PARAM_SHAPED`` (``"t"``: a DTensor in the param's layout, or a local-shard-shaped tensor that
the build wraps into one, no copy), ``SCALAR`` (``"s"``: a 0-d plain tensor such as Adam's
``step``), ``OWN_LAYOUT`` (``"r"``: a DTensor of its own global shape and placements on the
param's mesh, e.g. Adafactor's factors: saved as it is, its value ``(shape, placements)``) or
``PLAIN`` (``"n"``: a plain Python value); anything else raises ``StateLayoutError`` naming the
param and key. The kinds, and why others are refused: docs/internals.md, "Inside the checkpoint
layer".

A checkpoint of this package carries no pickled code of ours. Hyperparameters are stored as
``bool``, ``int``, ``float``, ``str``, ``None`` or tuples of those; a tensor hyperparameter (a
tensor ``lr`` of a capturable or fused optimizer) is stored as the Python number it holds and turned
back into a tensor of the live dtype and device on load.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "EXCLUDED_GROUP_KEYS",
    "OWN_LAYOUT",
    "PARAM_SHAPED",
    "PLAIN",
    "SCALAR",
    "EntryLayout",
    "PlainValueError",
    "StateLayoutError",
    "classify",
    "dtype_from_name",
    "dtype_name",
    "group_meta",
    "own_layout",
    "restore_like",
    "to_plain",
]

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
    placements)``). Not ``optim._engines._slots.Slot``, the wrapper's per-param cache."""

    kind: str
    dtype: str | None
    value: Any


# per-param keys of a torch param group: not hyperparameters
EXCLUDED_GROUP_KEYS = frozenset({"params", "param_names"})

_SCALARS = (bool, int, float, str, type(None))


class PlainValueError(TypeError):
    """A hyperparameter or state value that a checkpoint cannot hold as plain data."""


def to_plain(value: Any, where: str) -> Any:
    """``value`` as plain Python data; one-element tensors become numbers, lists become tuples."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PlainValueError(
                f"{where} is a tensor of shape {tuple(value.shape)}; only one-element tensor "
                "hyperparameters can be stored as plain numbers"
            )
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(to_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise PlainValueError(
        f"{where} is a {type(value).__name__}; checkpoints hold only bool, int, float, str, None "
        "and tuples of those. Store a plain value in the param group instead."
    )


def restore_like(live: Any, saved: Any) -> Any:
    """``saved`` in the form of ``live``: a tensor hyperparameter stays a (new) tensor of the live
    dtype, device and shape (apex's capturable FusedAdam keeps its group ``step`` and ``lr`` as
    shape ``[1]``, torch's as 0-d), a list stays a list, a tuple of tensors a tuple of tensors."""
    if isinstance(live, torch.Tensor) and not isinstance(saved, torch.Tensor):
        out = torch.tensor(saved, dtype=live.dtype, device=live.device)
        return out.reshape(live.shape) if live.numel() == 1 else out
    if (
        isinstance(live, (tuple, list))
        and isinstance(saved, (tuple, list))
        and len(live) == len(saved)
    ):
        return type(live)(restore_like(a, b) for a, b in zip(live, saved, strict=True))
    return saved


def group_meta(group: dict, where: str) -> dict[str, Any]:
    """The hyperparameters of a param group (every key but the per-param ones) as plain data."""
    return {
        k: to_plain(v, f"{where}[{k!r}]") for k, v in group.items() if k not in EXCLUDED_GROUP_KEYS
    }


# one PARAM_SHAPED layout per dtype: classify() returns it for most entries. Not the SCALAR ones:
# their dtype name goes into the table, whose pickle must stay byte for byte what it was (a
# fresh string per scalar; a shared one would be pickled once and referenced after)
_PARAM_SHAPED: dict[torch.dtype, EntryLayout] = {}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _param_shaped(dtype: torch.dtype) -> EntryLayout:
    layout = _PARAM_SHAPED.get(dtype)
    if layout is None:
        layout = _PARAM_SHAPED[dtype] = EntryLayout(PARAM_SHAPED, dtype_name(dtype), None)
    return layout


def own_layout(value: DTensor) -> tuple[tuple[int, ...], tuple]:
    """The value of an ``OWN_LAYOUT`` entry's layout: its global shape and placements."""
    return tuple(value.shape), tuple(value.placements)


def classify(fqn: str, key: str, value: Any, param: DTensor) -> EntryLayout:
    """How ``value``, the state ``key`` of the param ``fqn`` (the model's DTensor ``param``), is
    laid out; the value of a ``SCALAR`` layout is filled in later, batched.

    Raises:
        StateLayoutError: ``value`` is neither parameter-shaped (its global shape or its local
            shard's), nor 0-d, nor a DTensor on the param's mesh without ``Partial``, nor plain.
    """
    if isinstance(value, DTensor):
        if value.shape == param.shape:
            return _param_shaped(value.dtype)
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
        if value.shape == param._local_tensor.shape:
            return _param_shaped(value.dtype)
        raise StateLayoutError(
            f"state {fqn!r}[{key!r}] is a plain tensor of shape {tuple(value.shape)}, neither the "
            f"local shard's shape {tuple(param._local_tensor.shape)} nor a 0-d scalar: its layout "
            "across ranks is unknown, so it cannot be checkpointed as a resharding DTensor"
        )
    if isinstance(value, _SCALARS):
        return EntryLayout(PLAIN, None, value)
    raise StateLayoutError(
        f"state {fqn!r}[{key!r}] is a {type(value).__name__}; expected a tensor or a plain value"
    )


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype
