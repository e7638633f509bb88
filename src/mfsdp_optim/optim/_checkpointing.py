"""The wrapper's adapters to the checkpoint layer, for one base optimizer or several.

The checkpoint layer works on (base optimizer, ``ParamRecord`` list) pairs. Several base
optimizers hold disjoint params: their fsdp_dtensor state dicts are built one by one and merged
(their FQNs are disjoint; one ``param_to_group_meta`` table), and a load is split by FQN, every
part validated before any is applied, so a load stays all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .._infra.params import ParamRecord
from ._engines._engine import Engine
from ._kinds._kind_of import WHOLE_PARAM

__all__ = ["build_state_dict", "load_state_dict"]


def _held(engine: Engine, slot: Any) -> bool:
    """Whether this rank's base optimizer holds state for ``slot``'s param: the whole-param step
    gives every rank of a param's shard group its state (an empty piece included, and any of
    them may own the update), so the empty-shard filter leaves nothing out there."""
    return bool(slot.held) or engine.kind == WHOLE_PARAM


def records_of(engine: Engine) -> list[ParamRecord]:
    """Every param of the engine in base-optimizer order: FQN, DTensor, and the DTensor again
    where the base optimizer steps it on this rank (None where the empty-shard filter leaves it
    out)."""
    engine.table.sync()
    return [
        ParamRecord(s.fqn, s.param, s.param if _held(engine, s) else None)
        for s in engine.table.slots
    ]


@contextmanager
def _held_groups(engine: Engine) -> Iterator[None]:
    """With the empty-shard filter: the groups show only the params stepped on this rank, for
    the checkpoint layer (which creates state for every param it sees)."""
    if all(_held(engine, s) for s in engine.table.slots):
        yield
        return
    groups = engine.optimizer.param_groups
    saved = [list(g["params"]) for g in groups]
    try:
        for gi, g in enumerate(groups):
            g["params"][:] = engine.table.held_params(gi)
        yield
    finally:
        for g, params in zip(groups, saved, strict=True):
            g["params"][:] = params


def build_state_dict(
    engines: Sequence[Engine],
    *,
    is_loading: bool,
    init_state_fn: Callable[[torch.optim.Optimizer], None] | None,
) -> dict[str, Any]:
    """The fsdp_dtensor state dict over every engine's params."""
    from ..checkpoint import GroupMetaTable, OptimizerStateDict, build_sharded_state_dict

    parts = []
    for e in engines:
        records = records_of(e)
        e.invalidate()  # init_state_fn may create or replace state
        with _held_groups(e):
            parts.append(
                build_sharded_state_dict(
                    e.optimizer, records, is_loading=is_loading, init_state_fn=init_state_fn
                )
            )
    if len(parts) == 1:
        return parts[0]
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    table = GroupMetaTable.concat([p["param_to_group_meta"] for p in parts])
    return OptimizerStateDict(state=state, param_to_group_meta=table)


def load_state_dict(engines: Sequence[Engine], sd: dict[str, Any]) -> None:
    """Load the fsdp_dtensor state dict ``sd`` into every engine (all or nothing); the caller
    invalidates the engines' caches around it."""
    from ..checkpoint import load_sharded_state_dicts

    records = [records_of(e) for e in engines]
    parts = [sd] if len(engines) == 1 else _split(sd, records)
    triples = zip(engines, records, parts, strict=True)
    load_sharded_state_dicts([(e.optimizer, recs, part) for e, recs, part in triples])


def _split(sd: Any, records: list[list[ParamRecord]]) -> list[Any]:
    """``sd`` cut by FQN into one part per engine; FQNs no engine holds go to the first part,
    whose validation names them. A format-3 table is shared (each part reads its own FQNs)."""
    if not isinstance(sd, dict):
        return [sd] * len(records)
    known = {r.fqn for recs in records for r in recs}

    def cut(value: Any, names: set[str], first: bool) -> Any:
        if not isinstance(value, dict):
            return value
        return {k: v for k, v in value.items() if k in names or (first and k not in known)}

    parts = []
    for i, recs in enumerate(records):
        names = {r.fqn for r in recs}
        parts.append({k: cut(v, names, i == 0) for k, v in sd.items()})
    return parts
