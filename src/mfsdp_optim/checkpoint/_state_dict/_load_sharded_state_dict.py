"""``load_sharded_state_dict``: validate everything, agree on validity, only then mutate.

Map: ``load_sharded_state_dict`` (and ``load_sharded_state_dicts`` for several optimizers)
restores hyperparameters, scalar state and FQN-keyed state after ``dcp.load``, or copies a
state dict from elsewhere in; ``as_format2`` / ``as_format1`` bring formats 3 and 2 to the
format the checks work on; ``StateDictMismatchError`` what a refused load raises. Every rank
of the group calls it; one 8-byte agreement (``_infra.agreement``) precedes any write. What
happens to params saved without state: docs/concepts.md, "Inside the checkpoint layer".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.agreement import agree, by_rank
from ..._infra.host import paused_gc
from ..._infra.params import ParamRecord
from .._errors import StateDictMismatchError
from ._layout import local_shape
from ._table import as_table, is_table
from ._values import (
    EXCLUDED_GROUP_KEYS,
    EntryLayout,
    PlainValueError,
    StateLayoutError,
    classify,
    dtype_from_name,
    restore_like,
    to_plain,
)

__all__ = ["as_format1", "as_format2", "load_sharded_state_dict"]

_TOP_KEYS = {"state", "param_to_group_meta"}


def _scalar_value(fqn: str, item: Any) -> tuple[str, Any]:
    """``(key, value)`` of one ``(key, value, dtype)`` scalar triple of a format-2 leaf."""
    if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)):
        raise ValueError(
            f"param_to_group_meta {fqn!r}: a scalar entry must be (key, value, "
            f"dtype name or None), got {item!r}"
        )
    key, value, dtype = item
    return key, value if dtype is None else torch.tensor(value, dtype=dtype_from_name(dtype))


def as_format2(sd: dict) -> dict:
    """``sd`` with a format-3 ``param_to_group_meta`` (a ``GroupMetaTable`` or its tagged
    tuple) turned into format 2's dict ``{fqn: (hyperparameters, scalars)}`` of every FQN it
    covers; any other ``sd`` is returned as it is. Tensors are shared, ``sd`` is not mutated.
    Raises ``ValueError`` for a malformed tagged tuple."""
    if not isinstance(sd, dict) or not is_table(sd.get("param_to_group_meta")):
        return sd
    return {**sd, "param_to_group_meta": dict(as_table(sd["param_to_group_meta"]).leaves())}


def _own_leaves(sd: Any, records: Sequence[ParamRecord]) -> Any:
    """A format-3 ``sd`` with ``param_to_group_meta`` as a format-2 dict of the leaves of
    ``records`` only (the table covers every rank's params); any other ``sd`` as it is."""
    if not isinstance(sd, dict) or not is_table(sd.get("param_to_group_meta")):
        return sd
    table = as_table(sd["param_to_group_meta"])
    return {
        **sd,
        "param_to_group_meta": {r.fqn: table.leaf(r.fqn) for r in records if r.fqn in table},
    }


def as_format1(sd: dict) -> dict:
    """``sd`` with every format-2 or format-3 ``param_to_group_meta`` leaf ``(hyperparameters,
    scalars)`` turned into 0.1.0's form: a hyperparameter dict, and the scalars (as 0-d tensors
    of their dtype, or plain values) back inside ``state[fqn]``. Format-1 entries pass through;
    tensors are shared, ``sd`` is not mutated. Raises ``ValueError`` naming the FQN of a
    malformed leaf (or what is wrong with a malformed format-3 tuple)."""
    sd = as_format2(sd)
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("param_to_group_meta"), dict)
        or (not isinstance(sd.get("state"), dict))
    ):
        return sd
    state = dict(sd["state"])
    meta: dict[str, Any] = {}
    for fqn, leaf in sd["param_to_group_meta"].items():
        if not isinstance(leaf, tuple):
            meta[fqn] = leaf
            continue
        if len(leaf) != 2 or not all(isinstance(part, tuple) for part in leaf):
            raise ValueError(
                f"param_to_group_meta {fqn!r}: expected a dict (format 1) or a "
                f"(hyperparameters, scalars) tuple (format 2), got {leaf!r}"
            )
        hyper, scalars = leaf
        if not all(isinstance(kv, tuple) and len(kv) == 2 for kv in hyper):
            raise ValueError(
                f"param_to_group_meta {fqn!r}: hyperparameters must be (name, "
                f"value) pairs, got {hyper!r}"
            )
        meta[fqn] = dict(hyper)
        if scalars:
            entry = dict(state.get(fqn) or {})
            for item in scalars:
                key, value = _scalar_value(fqn, item)
                entry.setdefault(key, value)
            state[fqn] = entry
    return {**sd, "state": state, "param_to_group_meta": meta}


def _listing(what: str, names) -> list[str]:
    names = sorted(names)
    if not names:
        return []
    shown = ", ".join(repr(n) for n in names[:20])
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return [f"{what}: {shown}{more}"]


def _check_tensor(fqn, key, value, live, param) -> list[str]:
    where = f"state {fqn!r}[{key!r}]"
    if not isinstance(value, DTensor):
        return [f"{where}: expected a DTensor in the param's layout, got {type(value).__name__}"]
    out = []
    if value.shape != param.shape:
        out.append(f"{where}: global shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    if live is not None and value.dtype != live.dtype:
        out.append(f"{where}: dtype {value.dtype}, expected {live.dtype}")
    if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
        out.append(
            f"{where}: layout {value.device_mesh} {tuple(value.placements)}, expected the "
            f"param's {param.device_mesh} {tuple(param.placements)}"
        )
    elif value._local_tensor.shape != local_shape(param):
        out.append(
            f"{where}: local shape {tuple(value._local_tensor.shape)}, expected "
            f"{tuple(local_shape(param))}"
        )
    return out


def _check_own_layout(fqn, key, value, live, param) -> list[str]:
    """An ``"r"`` value: a DTensor on the param's mesh in the live value's shape, placements and
    dtype (what ``dcp.load`` into ``build_sharded_state_dict(is_loading=True)`` gives; DCP
    reshards by the target's placements), or, without live state, any non-Partial layout on the
    param's mesh."""
    where = f"state {fqn!r}[{key!r}]"
    if not isinstance(value, DTensor):
        return [f"{where}: expected a DTensor on the param's mesh, got {type(value).__name__}"]
    if live is None:
        try:
            classify(fqn, key, value, param)
        except StateLayoutError as exc:
            return [str(exc)]
        return []
    out = []
    if value.shape != live.shape:
        out.append(f"{where}: global shape {tuple(value.shape)}, expected {tuple(live.shape)}")
    if value.dtype != live.dtype:
        out.append(f"{where}: dtype {value.dtype}, expected {live.dtype}")
    if value.device_mesh != live.device_mesh or tuple(value.placements) != tuple(live.placements):
        out.append(
            f"{where}: layout {value.device_mesh} {tuple(value.placements)}, expected the live "
            f"state's {live.device_mesh} {tuple(live.placements)} (load into the target of "
            "sharded_state_dict(is_loading=True); DCP reshards into its placements)"
        )
    elif value._local_tensor.shape != live._local_tensor.shape:
        out.append(
            f"{where}: local shape {tuple(value._local_tensor.shape)}, expected "
            f"{tuple(live._local_tensor.shape)}"
        )
    return out


def _check_scalar(fqn, key, value, slot: EntryLayout | None) -> list[str]:
    where = f"state {fqn!r}[{key!r}]"
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or isinstance(value, DTensor):
            return [f"{where}: expected a scalar, got a tensor of shape {tuple(value.shape)}"]
        if slot is not None and slot.kind == "s" and str(value.dtype) != f"torch.{slot.dtype}":
            return [f"{where}: dtype {value.dtype}, expected torch.{slot.dtype}"]
        return []
    try:
        to_plain(value, where)
    except PlainValueError as exc:
        return [str(exc)]
    return []


def _check_entry(rec: ParamRecord, entry: Any, live: dict | None) -> list[str]:
    if not isinstance(entry, dict):
        return [f"state {rec.fqn!r}: expected a dict of state values, got {type(entry).__name__}"]
    out = []
    if live:
        out += _listing(f"state {rec.fqn!r}: missing state keys", set(live) - set(entry))
        out += _listing(f"state {rec.fqn!r}: unexpected state keys", set(entry) - set(live))
    for key, value in entry.items():
        lv = (live or {}).get(key)
        slot = None
        if lv is not None:
            try:
                slot = classify(rec.fqn, key, lv, rec.param)
            except StateLayoutError as exc:
                out.append(str(exc))
                continue
        if (slot is not None and slot.kind == "r") or (
            slot is None
            and isinstance(value, DTensor)
            and value.dim() > 0
            and value.shape != rec.param.shape
        ):
            out += _check_own_layout(
                rec.fqn, key, value, lv if slot is not None else None, rec.param
            )
        elif (slot is not None and slot.kind == "t") or (
            slot is None and isinstance(value, DTensor) and value.dim() > 0
        ):
            out += _check_tensor(rec.fqn, key, value, lv, rec.param)
        elif live and key not in live:
            continue  # already listed as unexpected
        else:
            out += _check_scalar(rec.fqn, key, value, slot)
    return out


def _validate(optimizer, records: Sequence[ParamRecord], sd: Any) -> list[str]:
    if not isinstance(sd, dict) or set(sd) != _TOP_KEYS:
        got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        return [
            f"expected a dict with exactly the keys {sorted(_TOP_KEYS)}, got {got} (convert "
            "the layout of get_optimizer_state_dict with from_torch_state_dict)"
        ]
    state, meta = sd["state"], sd["param_to_group_meta"]
    if not isinstance(state, dict) or not isinstance(meta, dict):
        return ["'state' and 'param_to_group_meta' must be dicts keyed by FQN"]
    by_fqn = {r.fqn: r for r in records}
    held = [r for r in records if r.opt_param is not None]
    errors = _listing("unexpected FQNs in 'state'", set(state) - set(by_fqn))
    errors += _listing("unexpected FQNs in 'param_to_group_meta'", set(meta) - set(by_fqn))
    errors += _listing("missing FQNs in 'param_to_group_meta'", {r.fqn for r in held} - set(meta))
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    seen_group_meta: dict[int, tuple[str, Any]] = {}
    for rec in held:
        gi = group_of.get(id(rec.opt_param))
        if gi is None:
            errors.append(f"{rec.fqn!r}: its opt_param is not a parameter of the base optimizer")
            continue
        if rec.fqn in meta:
            hyper = meta[rec.fqn]
            if not isinstance(hyper, dict):
                errors.append(f"param_to_group_meta {rec.fqn!r}: expected a dict")
                continue
            names = set(optimizer.param_groups[gi]) - EXCLUDED_GROUP_KEYS
            errors += _listing(
                f"param_to_group_meta {rec.fqn!r}: missing hyperparameters", names - set(hyper)
            )
            errors += _listing(
                f"param_to_group_meta {rec.fqn!r}: unexpected hyperparameters", set(hyper) - names
            )
            try:
                plain = to_plain(tuple(sorted(hyper.items())), f"param_to_group_meta {rec.fqn!r}")
            except PlainValueError as exc:
                errors.append(str(exc))
                continue
            if gi in seen_group_meta and seen_group_meta[gi][1] != plain:
                errors.append(
                    f"{seen_group_meta[gi][0]!r} and {rec.fqn!r} share param group {gi}"
                    " but their hyperparameters in the state dict differ"
                )
            seen_group_meta.setdefault(gi, (rec.fqn, plain))
        if rec.fqn in state:
            errors += _check_entry(rec, state[rec.fqn], optimizer.state.get(rec.opt_param))
    return errors


def _agree(errors: list[str], group) -> list[str]:
    """Every rank's errors, on every rank, each once with the ranks that found it: the
    rank-agreement protocol (``_infra.agreement.agree``), ONE ``all_reduce(MAX)`` of an 8-byte
    flag, and only when some rank found something, an object gather of the messages."""
    if not (dist.is_available() and dist.is_initialized()):
        return errors  # one process: its own errors, without rank numbers
    verdict = agree(errors, group)
    return by_rank((r, e) for r, f in verdict.failures.items() for e in f.lines)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.device == b.device
    )


def _apply(optimizer, records: Sequence[ParamRecord], sd: dict) -> None:
    state, meta = sd["state"], sd["param_to_group_meta"]
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    restored: set[int] = set()
    for rec in records:
        if rec.opt_param is None:
            continue
        gi = group_of[id(rec.opt_param)]
        if gi not in restored and rec.fqn in meta:
            group = optimizer.param_groups[gi]
            for k, v in meta[rec.fqn].items():
                group[k] = restore_like(group.get(k), v)
            restored.add(gi)
        if rec.fqn not in state:
            optimizer.state.pop(rec.opt_param, None)  # saved without state: never stepped
            continue
        live = optimizer.state.get(rec.opt_param) or {}
        entry = {}
        for key, value in state[rec.fqn].items():
            lv = live.get(key)
            if (
                isinstance(value, DTensor)
                and value.dim() > 0
                or (isinstance(lv, torch.Tensor) and lv.dim() > 0)
            ):
                src = value._local_tensor
                if lv is None:
                    entry[key] = value if isinstance(rec.opt_param, DTensor) else src
                    continue
                dst = lv._local_tensor if isinstance(lv, DTensor) else lv
                if not _same_storage(src, dst):
                    with torch.no_grad():
                        dst.copy_(src)
                entry[key] = lv
            elif isinstance(lv, torch.Tensor):
                if lv is not value:
                    with torch.no_grad():
                        lv.copy_(value) if isinstance(value, torch.Tensor) else lv.fill_(value)
                entry[key] = lv
            else:
                entry[key] = value
        optimizer.state[rec.opt_param] = entry


@paused_gc()
def load_sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    records: Sequence[ParamRecord],
    state_dict: dict,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Load a fsdp_dtensor state dict (see ``build_sharded_state_dict``) into ``optimizer``.

    ``state_dict["param_to_group_meta"]`` may be format 3 (a ``GroupMetaTable``, or the tagged
    tuple ``dcp.load`` put in its place; only the entries of ``records`` are read), format 2 or
    format 1 (dicts keyed by FQN).

    Checks, before touching anything: the top-level keys; FQNs in ``state`` (and in a format-2 or
    format-1 ``param_to_group_meta``) that no record names (unexpected); held params without
    ``param_to_group_meta`` (missing); hyperparameter names against the live param group; state
    keys against the live state; DTensor global shape, mesh, placements and dtype against the param
    and the live state; scalars. Every rank of ``group`` then shares its findings with ONE
    ``all_reduce`` (and, only when some rank found something, an ``all_gather_object`` of the
    messages); if any rank found anything, every rank raises, and no optimizer changed.

    Args:
        optimizer: The base optimizer to restore (hyperparameters, scalar state and
            FQN-keyed state; tensors ``dcp.load`` already wrote in place are left as they are,
            others are copied into the live state).
        records: One ``ParamRecord`` per trainable param, as given to
            [build_sharded_state_dict][mfsdp_optim.checkpoint.build_sharded_state_dict].
        state_dict: The fsdp_dtensor state dict: what ``build_sharded_state_dict(...,
            is_loading=True)`` returned after ``dcp.load`` filled it, or
            [from_torch_state_dict][mfsdp_optim.checkpoint.from_torch_state_dict] of a
            separately loaded dict.
        group: The ranks that call (default WORLD); every rank of it must call.

    Raises:
        StateDictMismatchError: On every rank, listing everything any rank found (a
            ``ValueError``); no optimizer changed.
    """
    load_sharded_state_dicts([(optimizer, records, state_dict)], group=group)


def load_sharded_state_dicts(
    parts: Sequence[tuple[torch.optim.Optimizer, Sequence[ParamRecord], dict]],
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``load_sharded_state_dict`` for several base optimizers over disjoint params: every part
    is validated and the ranks agree once before any optimizer changes (all or nothing)."""
    errors: list[str] = []
    converted = []
    for optimizer, records, state_dict in parts:
        try:
            sd = as_format1(_own_leaves(state_dict, records))
            errors += _validate(optimizer, records, sd)
            converted.append(sd)
        except Exception as exc:  # never leave the other ranks waiting in the collective
            errors.append(f"validation failed: {type(exc).__name__}: {exc}")
    errors = _agree(errors, group)
    if errors:
        shown = errors[:40]
        more = f"\n  ... and {len(errors) - 40} more" if len(errors) > 40 else ""
        raise StateDictMismatchError(
            "optimizer state dict does not match the optimizer (nothing was loaded):\n  "
            + "\n  ".join(shown)
            + more
        )
    for (optimizer, records, _), sd in zip(parts, converted, strict=True):
        _apply(optimizer, records, sd)
