"""``build_sharded_state_dict``: the fsdp_dtensor optimizer state dict of one rank (format 3).

Map: ``build_sharded_state_dict`` -> ``{"state": {fqn: {key: DTensor}}, "param_to_group_meta":
GroupMetaTable}`` (the table: ``_table``; ONE DCP item, identical on every rank, covering every
FQN any rank's optimizer holds); the keyspace agreed through ``_keyspace``; ``KeyspaceError``
when ranks disagree. Precondition: every rank of ``group`` calls it. The layout, and formats 1
and 2 that every loader still reads: docs/checkpoint.md, "The layout".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._infra.params import ParamRecord
from ._keyspace import (
    Keyspace,
    agree_keyspace,
    describe_state,
    digest,
    local_keyspace,
    merge,
)
from ._layout import placeholder, wrap
from ._materialize import materialize_optimizer_state
from ._table import GroupMetaTable, OptimizerStateDict

__all__ = ["KeyspaceError", "build_sharded_state_dict"]


class KeyspaceError(ValueError):
    """The ranks' optimizer states cannot be described consistently; raised on every rank."""


def _format(errors: list[str], limit: int = 30) -> str:
    shown = errors[:limit]
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return "\n  " + "\n  ".join(shown) + more


def build_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    records: Sequence[ParamRecord],
    *,
    is_loading: bool = False,
    init_state_fn: Callable[[torch.optim.Optimizer], None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict:
    """This rank's fsdp_dtensor state dict of ``optimizer`` over the params ``records`` describe.

    Every rank of ``group`` calls it. The keyspace is derived locally and agreed with ONE
    ``all_reduce`` of a fixed-size digest; only when the ranks' digests differ does it add ONE
    ``all_gather_object`` of compact descriptions. Afterwards every rank that
    holds a shard of a param (an empty one included) emits the same FQNs and tensor state keys, with
    zeros in the param's layout (empty when its local shard is empty) where its own optimizer holds
    no state. A param that no rank has state for has no ``"state"`` entry anywhere and an empty
    scalar part in its ``"param_to_group_meta"`` entry. ``"param_to_group_meta"`` is one
    ``GroupMetaTable``, identical on every rank of ``group``, covering every param any rank's
    optimizer holds.

    Args:
        optimizer: The base optimizer (a stock ``torch.optim.Optimizer`` over the params, or
            over local-shard aliases of them).
        records: One ``ParamRecord`` per trainable param: its FQN, the model's DTensor param
            and the tensor this rank's base optimizer holds for it (None when it holds none).
        is_loading: First give every param without state the state its first step would
            create, with ``step`` 0 and without moving params or hyperparameters, so DCP has
            tensors to load into.
        init_state_fn: With ``is_loading=True``, called on the optimizer instead to create that
            state.
        group: The ranks that call (default WORLD); it must contain every rank that holds any
            of the params.

    Returns:
        ``{"state": {fqn: {key: DTensor}}, "param_to_group_meta": GroupMetaTable}`` (an
            ``OptimizerStateDict``), the state DTensors sharing storage with the live state.

    Raises:
        KeyspaceError: On every rank, when some rank holds state that cannot be laid out
            (non-parameter-shaped tensors, non-plain hyperparameters) or ranks disagree on a
            param's keys, dtypes or hyperparameters (a ``ValueError``).
    """
    if is_loading:
        if init_state_fn is not None:
            init_state_fn(optimizer)
        else:
            materialize_optimizer_state(optimizer)
    local = describe_state(optimizer, records)
    keyspace = local_keyspace(local)
    table = _table(keyspace)
    descriptions = agree_keyspace(local, digest(local, table.fingerprint()), group)
    if descriptions is not None:
        keyspace, errors = merge(descriptions)
        if errors:
            raise KeyspaceError(
                "cannot build a rank-consistent optimizer state dict:" + _format(errors)
            )
        table = _table(keyspace)
    state: dict[str, dict] = {}
    for rec in records:
        slots = keyspace.state.get(rec.fqn)
        if not slots:
            continue
        own = local.state.get(rec.fqn, {})
        entry = {}
        for key, slot in slots:
            if slot.kind not in ("t", "r"):
                continue
            if key in own:
                entry[key] = wrap(own[key][1], rec.param)
            elif slot.kind == "t" or is_loading:
                entry[key] = placeholder(slot, rec.param)
            # else: an "r" value this rank lacks is not saved from here: its zeros could be the
            # copy of a replicated chunk that DCP keeps; the ranks that hold it write it
        if entry:
            state[rec.fqn] = entry
    return OptimizerStateDict(state=state, param_to_group_meta=table)


def _table(keyspace: Keyspace) -> GroupMetaTable:
    """``param_to_group_meta``: one ``(hyperparameters, scalars)`` leaf per FQN of
    ``keyspace.meta`` (the params this rank's optimizer holds when the digests agree, every
    rank's after a merge), in its order, which is the same on every rank either way."""
    sorted_of: dict[int, tuple] = {}  # a param group's hyperparameter dict is shared: sort once

    def leaves():
        for fqn, hyper in keyspace.meta.items():
            h = sorted_of.get(id(hyper))
            if h is None:
                h = sorted_of[id(hyper)] = tuple(sorted(hyper.items()))
            scalars = tuple(
                (k, s.value, s.dtype if s.kind == "s" else None)
                for k, s in keyspace.state.get(fqn, ())
                if s.kind in ("s", "n")
            )
            yield fqn, (h, scalars)

    return GroupMetaTable.from_leaves(leaves())
