"""The rank-consistent keyspace, learned with ONE collective for the whole state dict.

Each rank describes what its own base optimizer holds, compactly::

    {"slots":  [((key, kind, dtype, value), ...), ...],   # distinct state signatures
     "metas":  [((hyperparameter, value), ...), ...],     # distinct group hyperparameters
     "fqns":   {fqn: (slot_index or -1, meta_index)},     # params this rank's optimizer holds
     "errors": [str, ...]}                                # what this rank could not describe

(``value`` is the scalar of a ``"s"``/``"n"`` slot such as ``step``, ``None`` for tensors; a
model's params share a handful of signatures, so the description is about one FQN string per
param.) One ``all_gather_object`` over the group hands every rank every description, and every
rank merges them the same way, so every rank reaches the same keyspace and the same errors:
nothing is raised before the collective, so no rank is left waiting in it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._comm import all_gather_objects
from .._params import ParamRecord
from ._layout import Slot, StateLayoutError, classify
from ._values import PlainValueError, group_meta

__all__ = ["Keyspace", "LocalState", "describe", "gather", "merge"]


class LocalState(NamedTuple):
    """This rank's live state, classified: fqn -> {key: (Slot, value)} for params it holds."""

    state: dict[str, dict[str, tuple[Slot, Any]]]
    meta: dict[str, dict[str, Any]]
    description: dict


class Keyspace(NamedTuple):
    """The merged, rank-consistent view: ordered slots per FQN with state, meta per held FQN."""

    state: dict[str, tuple[tuple[str, Slot], ...]]
    meta: dict[str, dict[str, Any]]


def _group_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}


def describe(optimizer: torch.optim.Optimizer, records: Sequence[ParamRecord]) -> LocalState:
    """Classify this rank's state and build its compact description (no collective)."""
    errors: list[str] = []
    group_of = _group_index(optimizer)
    metas: list[tuple] = []
    meta_index: dict[int, int] = {}
    meta_plain: dict[int, dict] = {}
    state: dict[str, dict[str, tuple[Slot, Any]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    scalars: dict[tuple, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
    for rec in records:
        if rec.opt_param is None:
            continue
        gi = group_of.get(id(rec.opt_param))
        if gi is None:
            errors.append(f"{rec.fqn!r}: its opt_param is not a parameter of the base optimizer")
            continue
        if gi not in meta_index:
            try:
                plain = group_meta(optimizer.param_groups[gi], f"param_groups[{gi}]")
            except PlainValueError as exc:
                errors.append(str(exc))
                plain = {}
            meta_index[gi] = len(metas)
            meta_plain[gi] = plain
            metas.append(tuple(sorted(plain.items())))
        meta[rec.fqn] = meta_plain[gi]
        live = optimizer.state.get(rec.opt_param)
        if not live:
            continue
        entries: dict[str, tuple[Slot, Any]] = {}
        for key, value in live.items():
            try:
                slot = classify(rec.fqn, key, value, rec.param)
            except StateLayoutError as exc:
                errors.append(str(exc))
                continue
            if slot.kind == "s":
                scalars[(value.device, value.dtype)].append((rec.fqn, key, value))
            entries[key] = (slot, value)
        state[rec.fqn] = entries
    # one host transfer per (device, dtype) of scalar state, not one .item() per param
    for items in scalars.values():
        values = torch.stack([t.detach() for _, _, t in items]).tolist()
        for (fqn, key, _), v in zip(items, values, strict=True):
            slot, value = state[fqn][key]
            state[fqn][key] = (slot._replace(value=v), value)
    slots: list[tuple] = []
    slot_index: dict[tuple, int] = {}
    fqns: dict[str, tuple[int, int]] = {}
    for rec in records:
        if rec.fqn not in meta:
            continue
        sid = -1
        if rec.fqn in state:
            sig = tuple(sorted((k, s.kind, s.dtype, s.value) for k, (s, _) in
                               state[rec.fqn].items()))
            sid = slot_index.setdefault(sig, len(slots))
            if sid == len(slots):
                slots.append(sig)
        fqns[rec.fqn] = (sid, meta_index[group_of[id(rec.opt_param)]])
    description = {"slots": slots, "metas": metas, "fqns": fqns, "errors": errors}
    return LocalState(state, meta, description)


def gather(description: dict, group: dist.ProcessGroup | None) -> list[dict]:
    """Every rank's description: the keyspace's one collective (none without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [description]
    return all_gather_objects(description, group)


def merge(descriptions: list[dict]) -> tuple[Keyspace, list[str]]:
    """The keyspace every rank agrees on, and the errors every rank will raise."""
    errors: list[str] = []
    for rank, d in enumerate(descriptions):
        errors.extend(f"rank {rank}: {e}" for e in d["errors"])
    state: dict[str, tuple[tuple[str, Slot], ...]] = {}
    shape_of: dict[str, tuple] = {}
    meta: dict[str, dict[str, Any]] = {}
    meta_of: dict[str, tuple] = {}
    owner: dict[str, int] = {}
    for rank, d in enumerate(descriptions):
        slots, metas = d["slots"], d["metas"]
        for fqn, (sid, mid) in d["fqns"].items():
            m = metas[mid]
            if fqn not in meta_of:
                meta_of[fqn] = m
                meta[fqn] = dict(m)
                owner[fqn] = rank
            elif meta_of[fqn] != m:
                errors.append(
                    f"{fqn!r}: hyperparameters differ between rank {owner[fqn]} "
                    f"({dict(meta_of[fqn])}) and rank {rank} ({dict(m)})"
                )
            if sid < 0:
                continue
            sig = slots[sid]
            structure = tuple((k, kind, dtype) for k, kind, dtype, _ in sig)
            if fqn not in state:
                state[fqn] = tuple((k, Slot(kind, dtype, v)) for k, kind, dtype, v in sig)
                shape_of[fqn] = structure
            elif shape_of[fqn] != structure:
                errors.append(
                    f"{fqn!r}: ranks hold different state keys or dtypes: "
                    f"{list(shape_of[fqn])} vs rank {rank}: {list(structure)}"
                )
    return Keyspace(state, meta), errors
