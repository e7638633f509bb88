"""The rank-consistent keyspace: derived locally on every rank, agreed with a fixed-size digest.

Map: ``describe_state`` this rank's ``LocalState`` (per FQN the sorted ``(state key, dtype)``
signature, ``derive_signature`` for a param its optimizer does not hold, plus the table it will
emit); ``digest`` + ``agree_keyspace`` (over ``_infra.agreement.agree``): ONE 32-byte
``all_reduce``, all match? ``local_keyspace`` the common case, ``merge`` the detailed
exchange's fallback (one ``all_gather_object`` of compact descriptions). The decision to fall
back is the all-reduce's result, so every rank issues the same collectives; nothing is raised
before one. ``scratch_copy`` (an optimizer stepping zero clones: used here to derive signatures
and by ``_materialize``, which comes after this module on the build path). The protocol and the
description's fields: docs/internals.md, "Inside the checkpoint layer".
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._infra import agreement
from .._infra.params import ParamRecord
from ._layout import EntryLayout, StateLayoutError, classify
from ._values import PlainValueError, dtype_name, group_meta

__all__ = [
    "Keyspace",
    "LocalState",
    "agree_keyspace",
    "derive_signature",
    "describe_state",
    "merge",
    "scratch_copy",
]

Signature = tuple[tuple[str, str], ...]  # sorted (state key, dtype name) of tensor state


def scratch_copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` with its own empty state and no step hooks, for stepping
    other params with the class's own ``step``. Every attribute is shared (``copy.copy`` would
    keep only what ``Optimizer.__getstate__`` names: defaults, state, param_groups, and so drop
    e.g. apex FusedAdam's ``capturable`` and ``param_groups_master``); the caller sets
    ``param_groups`` (and any list kept beside them) before stepping it."""
    scratch = object.__new__(type(optimizer))
    scratch.__dict__.update(optimizer.__dict__)
    scratch.state = defaultdict(dict)
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    return scratch


class LocalState(NamedTuple):
    """This rank's live state, classified: fqn -> {key: (EntryLayout, value)} for the params it
    holds."""

    state: dict[str, dict[str, tuple[EntryLayout, Any]]]
    meta: dict[str, dict[str, Any]]
    description: dict
    signatures: dict[str, Signature]  # every record's tensor signature, derived where no state


class Keyspace(NamedTuple):
    """The merged, rank-consistent view: ordered slots per FQN with state, meta per held FQN."""

    state: dict[str, tuple[tuple[str, EntryLayout], ...]]
    meta: dict[str, dict[str, Any]]


def _group_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}


def derive_signature(
    optimizer: torch.optim.Optimizer,
    group: dict,
    dtype: torch.dtype,
) -> Signature:
    """The parameter-shaped state keys and dtypes that ``type(optimizer)``'s first step creates
    for a param of ``dtype`` in a group with ``group``'s hyperparameters, learned by stepping a
    scratch copy on ONE zero-element param (nothing of ``optimizer`` is touched). Keys whose first
    step creates none (SGD without momentum) give ``()``; an optimizer that cannot be stepped this
    way (a closure, sparse grads) gives ``(("?", "?"),)``, which never matches a real signature, so
    the agreement falls back to learning the keys from the ranks that hold them."""
    scratch = scratch_copy(optimizer)
    p = torch.zeros(0, dtype=dtype)
    p.grad = torch.zeros_like(p)
    scratch.param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}]
    try:
        with torch.no_grad():
            type(optimizer).step(scratch)
    except Exception:  # noqa: BLE001 - any failure just means "learn it from the owners"
        return (("?", "?"),)
    new = scratch.state.get(p) or {}
    return tuple(
        sorted(
            (k, dtype_name(v.dtype))
            for k, v in new.items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        )
    )


def describe_state(optimizer: torch.optim.Optimizer, records: Sequence[ParamRecord]) -> LocalState:
    """Classify this rank's state and build its compact description (no collective)."""
    errors: list[str] = []
    group_of = _group_index(optimizer)
    metas: list[tuple] = []
    meta_index: dict[int, int] = {}
    meta_plain: dict[int, dict] = {}
    state: dict[str, dict[str, tuple[EntryLayout, Any]]] = {}
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
        entries: dict[str, tuple[EntryLayout, Any]] = {}
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
            sig = tuple(
                sorted((k, s.kind, s.dtype, s.value) for k, (s, _) in state[rec.fqn].items())
            )
            sid = slot_index.setdefault(sig, len(slots))
            if sid == len(slots):
                slots.append(sig)
        fqns[rec.fqn] = (sid, meta_index[group_of[id(rec.opt_param)]])
    description = {"slots": slots, "metas": metas, "fqns": fqns, "errors": errors}
    signatures = _signatures(optimizer, records, state, group_of)
    return LocalState(state, meta, description, signatures)


def _signatures(optimizer, records, state, group_of) -> dict[str, Signature]:
    """Every record's tensor signature: from its live state; ``()`` where the optimizer holds the
    param without state; derived from the class's defaults where the empty-shard filter dropped
    it (cached per dtype: a handful of zero-element steps at most)."""
    derived: dict[torch.dtype, Signature] = {}
    out: dict[str, Signature] = {}
    for rec in records:
        entries = state.get(rec.fqn)
        if entries is not None:
            out[rec.fqn] = tuple(
                sorted(
                    (k, s.dtype or "") if s.kind == "t" else (k, f"r:{s.dtype}:{s.value!r}")
                    for k, (s, _) in entries.items()
                    if s.kind in ("t", "r")
                )
            )
            continue
        if rec.opt_param is not None:
            out[rec.fqn] = ()  # held but never stepped here: no state, as on its other ranks
            continue
        # dropped by the empty-shard filter: not in any group here, so the class's defaults
        if rec.param.dtype not in derived:
            derived[rec.param.dtype] = derive_signature(
                optimizer, optimizer.defaults, rec.param.dtype
            )
        out[rec.fqn] = derived[rec.param.dtype]
    return out


def digest(local: LocalState, table_fingerprint: str) -> list[int]:
    """Two 62-bit hashes: of every record's (fqn, tensor signature) in order, and of the
    fingerprint of the ``param_to_group_meta`` table this rank would emit (its whole content:
    FQNs, order, values). Equal on every rank iff (up to hash collisions) the ranks hold the
    same FQNs with the same parameter-shaped keys and would emit identical tables; a rank whose
    optimizer holds fewer params (the empty-shard filter) therefore forces the merge."""
    # repr, not pickle: pickle's memo makes equal values that share objects serialise apart
    out = agreement.digest(repr(tuple(local.signatures.items())), table_fingerprint)
    if local.description["errors"]:
        out[0] = -1  # a rank that could not describe itself forces the detailed path
    return out


def agree_keyspace(
    local: LocalState, values: list[int], group: dist.ProcessGroup | None
) -> list | None:
    """None on every rank iff every rank of ``group`` passed the same non-negative ``values``
    (``digest``), else every rank's description, on every rank: the rank-agreement protocol
    (``_infra.agreement.agree``), ONE ``all_reduce(MAX)`` of ``[v, -v]`` (16 bytes per value,
    independent of the world size), then, only when they differ, ONE object gather. A negative
    value (a rank that could not describe itself) is never agreed to, even when every rank
    passes it."""
    verdict = agreement.agree(None, group, digest=values, detail=local.description)
    return None if verdict.same else verdict.details


def local_keyspace(local: LocalState) -> Keyspace:
    """The keyspace of this rank alone: what every rank holds when the digests agree."""
    state: dict[str, tuple[tuple[str, EntryLayout], ...]] = {}
    for fqn, entries in local.state.items():
        state[fqn] = tuple((k, s) for k, (s, _) in sorted(entries.items()))
    for fqn, sig in local.signatures.items():
        if fqn not in state and sig:  # held without state here: the derived keys
            state[fqn] = tuple((k, EntryLayout("t", dt, None)) for k, dt in sig)
    return Keyspace(state, dict(local.meta))


def merge(descriptions: list[dict]) -> tuple[Keyspace, list[str]]:
    """The keyspace every rank agrees on, and the errors every rank will raise."""
    errors: list[str] = []
    for rank, d in enumerate(descriptions):
        errors.extend(f"rank {rank}: {e}" for e in d["errors"])
    state: dict[str, tuple[tuple[str, EntryLayout], ...]] = {}
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
            # an "r" slot's value (its global shape and placements) is part of its structure
            structure = tuple(
                (k, kind, dtype, v if kind == "r" else None) for k, kind, dtype, v in sig
            )
            if fqn not in state:
                state[fqn] = tuple((k, EntryLayout(kind, dtype, v)) for k, kind, dtype, v in sig)
                shape_of[fqn] = structure
            elif shape_of[fqn] != structure:
                errors.append(
                    f"{fqn!r}: ranks hold different state keys, dtypes or layouts: "
                    f"{list(shape_of[fqn])} vs rank {rank}: {list(structure)}"
                )
            elif state[fqn] != tuple((k, EntryLayout(kind, dtype, v)) for k, kind, dtype, v in sig):
                errors.append(
                    f"{fqn!r}: ranks hold different scalar state: "
                    f"{[(k, s.value) for k, s in state[fqn] if s.kind in 'sn']} vs rank {rank}: "
                    f"{[(k, v) for k, kind, _, v in sig if kind in 'sn']} (DCP would keep one)"
                )
    return Keyspace(state, meta), errors
