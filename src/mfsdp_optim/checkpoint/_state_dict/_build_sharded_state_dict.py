"""``build_sharded_state_dict``: the fsdp_dtensor optimizer state dict of one rank (format 3).

Map: ``build_sharded_state_dict`` -> ``{"state": {fqn: {key: DTensor}}, "param_to_group_meta":
GroupMetaTable}`` (the table: ONE DCP item, identical on every rank, covering every FQN any
rank's optimizer holds); ``KeyspaceError`` when ranks disagree. Precondition: every rank of
``group`` calls it. The layout, and formats 1 and 2 that every loader still reads:
docs/checkpoint.md, "The layout".

The walk: this module is the orchestrator. It calls each stage's one entry once, in this order,
and each stage returns for good (``tests/checkpoint/test_build_walk.py`` traces it):

1. ``_materialize_optimizer_state.first_step_state``: state for a load target (``is_loading``), and
   the keys a param this rank's optimizer does not hold would get;
2. ``_keyspace.agreed_keyspace``: describe, digest, agree (ONE ``all_reduce``), merge (ONE
   gather, only when the digests differ);
3. ``_table.GroupMetaTable.from_keyspace``: ``param_to_group_meta`` from the agreed keyspace;
4. ``_layout.state_dtensors``: the ``"state"`` DTensors.

A stage calls only leaves (``_values``, ``_infra``), never another stage. Imports point one way,
from a later stage to an earlier one, for types only: ``_layout`` and ``_table`` -> ``_keyspace``
(``Keyspace``) -> ``_materialize_optimizer_state`` (``Signature``); ``_build_sharded_state_dict``
imports all four.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..._infra.host import paused_gc
from ..._infra.params import ParamRecord
from .._errors import KeyspaceError
from ._keyspace import agreed_keyspace
from ._layout import state_dtensors
from ._materialize_optimizer_state import first_step_state
from ._table import GroupMetaTable, OptimizerStateDict

__all__ = ["build_sharded_state_dict"]


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
    with paused_gc():  # tens of thousands of small containers: _infra.host says why
        derived = first_step_state(
            optimizer, records, is_loading=is_loading, init_state_fn=init_state_fn
        )
        keyspace, errors = agreed_keyspace(optimizer, records, derived, group)
        if errors:
            raise KeyspaceError(
                "cannot build a rank-consistent optimizer state dict:" + _format(errors)
            )
        table = GroupMetaTable.from_keyspace(keyspace)
        state = state_dtensors(records, keyspace, is_loading=is_loading)
        return OptimizerStateDict(state=state, param_to_group_meta=table)
