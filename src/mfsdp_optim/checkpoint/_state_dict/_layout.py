"""Stage 4 of the build, the last: the state dict's DTensors, from the agreed keyspace.

Map: ``state_dtensors`` (the stage's one entry) gives every record whose FQN has slots in the
agreed ``Keyspace`` its ``{key: value}``: this rank's own state value as a DTensor in the param's
layout (sharing storage) or, where this rank holds none, the ``placeholder`` of the
slot's ``EntryLayout`` (what a slot's kind means: ``_values``). ``local_shape`` the local shard's
shape.

Imports: the leaves ``_values`` and ``_infra.placement``; ``_keyspace``'s ``Keyspace`` for types
only. Nothing of the build's other stages is called from here (the walk:
``_build_sharded_state_dict``'s map).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..._infra.params import ParamRecord
from ..._infra.placement import in_layout_of
from ._values import OWN_LAYOUT, PARAM_SHAPED, SCALAR, EntryLayout, dtype_from_name

if TYPE_CHECKING:
    from ._keyspace import Keyspace

__all__ = ["local_shape", "placeholder", "state_dtensors"]


def local_shape(param: DTensor) -> torch.Size:
    return param._local_tensor.shape


def state_dtensors(
    records: Sequence[ParamRecord], keyspace: Keyspace, *, is_loading: bool
) -> dict[str, dict[str, Any]]:
    """``{fqn: {key: DTensor}}``: the ``"state"`` of the state dict, over ``records`` in order.

    Per FQN with slots in ``keyspace.state``, each ``PARAM_SHAPED`` or ``OWN_LAYOUT`` slot: this
    rank's own value (``keyspace.own``) wrapped in the param's layout, sharing storage; else a
    ``PARAM_SHAPED`` slot's zeros in the param's layout (empty when its local shard is empty);
    an ``OWN_LAYOUT`` slot's zeros only when ``is_loading`` (saving, they could be the copy of a
    replicated chunk that DCP keeps: the ranks that hold the value write it). ``SCALAR`` and
    ``PLAIN`` slots live in the table, not here. An FQN left with no entry is left out. Purely
    local: no collective.
    """
    state: dict[str, dict[str, Any]] = {}
    for rec in records:
        slots = keyspace.state.get(rec.fqn)
        if not slots:
            continue
        own = keyspace.own.get(rec.fqn, {})
        entry = {}
        for key, slot in slots:
            kind = slot.kind
            if kind != PARAM_SHAPED and kind != OWN_LAYOUT:
                continue
            mine = own.get(key)
            if mine is not None:  # this rank's value, as a DTensor in the param's layout
                value = mine[1]
                entry[key] = value if isinstance(value, DTensor) else in_layout_of(value, rec.param)
            elif kind == PARAM_SHAPED or is_loading:
                entry[key] = placeholder(slot, rec.param)
        if entry:
            state[rec.fqn] = entry
    return state


def placeholder(slot: EntryLayout, param: DTensor) -> Any:
    """The value a rank without state emits for ``slot``: zeros in the parameter's layout (empty
    when its local shard is empty), zeros in an ``OWN_LAYOUT`` slot's own shape and placements on
    the parameter's mesh, or the owners' scalar value."""
    if slot.kind == PARAM_SHAPED:
        assert slot.dtype is not None  # classify() names the dtype of every tensor slot
        local = torch.zeros(
            local_shape(param), dtype=dtype_from_name(slot.dtype), device=param._local_tensor.device
        )
        return in_layout_of(local, param)
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
