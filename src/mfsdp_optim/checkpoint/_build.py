"""``build_sharded_state_dict``: the fsdp_dtensor optimizer state dict of one rank.

Layout (``fqn`` from the model's ``named_parameters()``; format 2, since 0.2.0)::

    {"state": {"layers.0.weight": {"exp_avg": DTensor, "exp_avg_sq": DTensor},
               ...},
     "param_to_group_meta": {"layers.0.weight": (
         (("betas", (0.9, 0.999)), ("eps", 1e-08), ("lr", 0.001), ...),   # hyperparameters
         (("step", 12.0, "float32"),)),                                   # scalar state
         ...}}

``state[fqn]`` holds the parameter-shaped state only: DTensors in the parameter's layout, sharing
storage with the live state. ``param_to_group_meta[fqn]`` is ONE tuple ``(hyperparameters,
scalars)``: the param group's hyperparameters (every key but ``params``) as sorted ``(name,
plain value)`` pairs, and the param's scalar state (``step``) as sorted ``(key, value, dtype)``
triples, ``dtype`` the name of the 0-d tensor's dtype (``"float32"``) or ``None`` for a plain
Python value. DCP stores a tuple whole, so a param costs its state tensors plus one small item
(format 1, 0.1.0, had a dict per FQN: one item per hyperparameter, and one ``step`` tensor
per param). DCP flattens it to keys ``optimizer.state.layers.0.weight.exp_avg`` and
``optimizer.param_to_group_meta.layers.0.weight`` (with the ``"optimizer"`` prefix the caller
saves it under). Only ranks whose base optimizer holds the param emit its
``param_to_group_meta`` entry (DCP keeps one copy; they all hold the same); every rank with a
shard (an empty one included) emits its ``state`` tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._params import ParamRecord
from ._keyspace import Keyspace, agree, describe, digest, gather, local_keyspace, merge
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
    params) calls it. The keyspace is derived locally and agreed with ONE ``all_reduce`` of a
    fixed-size digest; only when the ranks' digests differ does it add ONE ``all_gather_object``
    of compact descriptions (see ``_keyspace``). Afterwards every rank that holds a shard of a
    param (an empty one included) emits the same FQNs and tensor state keys, with zeros in the
    param's layout (empty when its local shard is empty) where its own optimizer holds no state.
    A param that no rank has state for has no ``"state"`` entry anywhere and an empty scalar part
    in its ``"param_to_group_meta"`` entry.

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
    keyspace = local_keyspace(local)
    leaves = _leaves(records, keyspace)
    if not agree(digest(local, list(leaves.values())), group):
        keyspace, errors = merge(gather(local.description, group))
        if errors:
            raise KeyspaceError(
                "cannot build a rank-consistent optimizer state dict:" + _format(errors)
            )
        leaves = _leaves(records, keyspace)
    state: dict[str, dict] = {}
    for rec in records:
        slots = keyspace.state.get(rec.fqn)
        if not slots:
            continue
        own = local.state.get(rec.fqn, {})
        entry = {}
        for key, slot in slots:
            if slot.kind != "t":
                continue
            if key in own:
                entry[key] = wrap(own[key][1], rec.param)
            else:
                entry[key] = placeholder(slot, rec.param)
        if entry:
            state[rec.fqn] = entry
    return {"state": state, "param_to_group_meta": leaves}


def _leaves(records: Sequence[ParamRecord], keyspace: Keyspace) -> dict[str, tuple]:
    """``param_to_group_meta``: one ``(hyperparameters, scalars)`` tuple per param this rank's
    optimizer holds (``keyspace.meta`` has exactly those)."""
    out: dict[str, tuple] = {}
    for rec in records:
        hyper = keyspace.meta.get(rec.fqn)
        if hyper is None or rec.opt_param is None:
            continue
        scalars = tuple(
            (k, s.value, s.dtype if s.kind == "s" else None)
            for k, s in keyspace.state.get(rec.fqn, ())
            if s.kind != "t"
        )
        out[rec.fqn] = (tuple(sorted(hyper.items())), scalars)
    return out
