"""``build_sharded_state_dict``: the fsdp_dtensor optimizer state dict of one rank.

Layout (``fqn`` from the model's ``named_parameters()``)::

    {"state": {"layers.0.weight": {"exp_avg": DTensor, "exp_avg_sq": DTensor,
                                   "step": tensor(12.)},
               ...},
     "param_to_group_meta": {"layers.0.weight": {"lr": 0.001, "betas": (0.9, 0.999), ...},
                             ...}}

DCP flattens it to keys ``optimizer.state.layers.0.weight.exp_avg`` and
``optimizer.param_to_group_meta.layers.0.weight.lr`` (with the ``"optimizer"`` prefix the caller
saves it under). Parameter-shaped state is a DTensor in its parameter's layout, sharing storage
with the live state; scalar state stays a plain tensor or number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._params import ParamRecord
from ._keyspace import describe, gather, merge
from ._layout import placeholder, wrap
from ._materialize import materialize_optimizer_state

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

    Every rank of ``group`` (default WORLD; it must contain every rank that holds any of the
    params) calls it: it runs ONE ``all_gather_object`` for the whole state dict, and afterwards
    every rank that holds a shard of a param (an empty one included) emits the same FQNs and state
    keys, with placeholders where its own optimizer holds no state: zeros in the param's layout
    (empty when its local shard is empty) and the owners' scalar values (``step``), so DCP's
    deduplication of plain tensors sees one value. A param that no rank has state for has no
    ``"state"`` entry anywhere; it keeps its ``"param_to_group_meta"`` entry.

    ``is_loading=True`` first gives every param without state the state its first step would
    create, with ``step`` 0 and without moving params or hyperparameters (``init_state_fn``, when
    given, is called on the optimizer instead), so DCP has tensors to load into.

    Raises ``KeyspaceError`` (a ``ValueError``) on every rank when some rank holds state that
    cannot be laid out (non-parameter-shaped tensors, non-plain hyperparameters) or ranks disagree
    on a param's keys, dtypes or hyperparameters.
    """
    if is_loading:
        if init_state_fn is not None:
            init_state_fn(optimizer)
        else:
            materialize_optimizer_state(optimizer)
    local = describe(optimizer, records)
    keyspace, errors = merge(gather(local.description, group))
    if errors:
        raise KeyspaceError("cannot build a rank-consistent optimizer state dict:" +
                            _format(errors))
    state: dict[str, dict] = {}
    meta: dict[str, dict] = {}
    for rec in records:
        slots = keyspace.state.get(rec.fqn)
        if slots is not None:
            own = local.state.get(rec.fqn, {})
            entry = {}
            for key, slot in slots:
                if key in own:
                    s, value = own[key]
                    entry[key] = wrap(value, rec.param) if s.kind == "t" else value
                else:
                    entry[key] = placeholder(slot, rec.param)
            state[rec.fqn] = entry
        hyper = local.meta.get(rec.fqn, keyspace.meta.get(rec.fqn))
        if hyper is not None:
            meta[rec.fqn] = dict(hyper)
    return {"state": state, "param_to_group_meta": meta}
