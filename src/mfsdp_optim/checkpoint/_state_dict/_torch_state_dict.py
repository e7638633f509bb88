"""Conversions between the fsdp_dtensor layout and torch's ``get_optimizer_state_dict`` layout.

Map: ``to_torch_state_dict`` (fsdp_dtensor formats 1-3, or the tagged tuple ``dcp.load`` leaves
in place of the table -> torch's unflattened ``{"state", "param_groups"}``) and
``from_torch_state_dict`` (back). Parameter-shaped tensors are shared, never copied; scalar state
(``step``) moves between a 0-d tensor in ``state[fqn]`` and a number in the table's leaf. The
inputs are never mutated. Both layouts side by side: docs/concepts.md, "Inside the checkpoint
layer".
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._load_sharded_state_dict import as_format1
from ._table import GroupMetaTable, OptimizerStateDict
from ._values import EXCLUDED_GROUP_KEYS, dtype_name, to_plain

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]


def from_torch_state_dict(osd: dict) -> dict:
    """torch's unflattened optimizer state dict -> fsdp_dtensor layout, format 3.

    DTensors and other non-0-d tensors are shared in ``state``; 0-d tensors and plain values,
    i.e. ``step``, become numbers in the param's leaf of the ``param_to_group_meta`` table, which
    covers every FQN of ``param_groups``, in their order. ``osd`` is not mutated.

    Args:
        osd: torch's unflattened optimizer state dict (``get_optimizer_state_dict`` with
            ``StateDictOptions(flatten_optimizer_state_dict=False)``): ``{"state": {fqn:
            {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    Returns:
        ``{"state": {fqn: {key: tensor}}, "param_to_group_meta": GroupMetaTable}``.

    Raises:
        ValueError: ``osd`` is not such a dict: other top-level keys, a flattened state dict,
            param ids instead of FQNs (``optimizer.state_dict()``), or an FQN in more than one
            param group.
        TypeError: A hyperparameter or scalar state value a checkpoint cannot hold as plain
            data (a multi-element tensor, an arbitrary object).
    """
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        got = sorted(osd) if isinstance(osd, dict) else type(osd).__name__
        raise ValueError(f"expected {{'state': ..., 'param_groups': [...]}}, got {got}")
    state = osd["state"]
    flat = [k for k in state if isinstance(k, str) and not isinstance(state[k], dict)]
    if flat:
        raise ValueError(
            f"state entries {flat[:5]} are not dicts: this looks like a flattened optimizer state "
            "dict (flatten_optimizer_state_dict=True); pass the unflattened one"
        )
    hyper_of: dict[str, tuple] = {}
    for gi, group in enumerate(osd["param_groups"]):
        hyper = tuple(
            sorted(
                (k, to_plain(v, f"param_groups[{gi}][{k!r}]"))
                for k, v in group.items()
                if k not in EXCLUDED_GROUP_KEYS
            )
        )
        for fqn in group["params"]:
            if not isinstance(fqn, str):
                raise ValueError(
                    f"param_groups[{gi}]['params'] holds {type(fqn).__name__} ids, not FQNs: pass "
                    "the state dict of get_optimizer_state_dict, not optimizer.state_dict()"
                )
            if fqn in hyper_of:
                raise ValueError(f"{fqn!r} appears in more than one param group")
            hyper_of[fqn] = hyper
    tensors: dict[str, dict] = {}
    scalars: dict[str, tuple] = {}
    for fqn, entry in state.items():
        tensors[fqn] = {k: v for k, v in entry.items() if _is_param_shaped(v)}
        scalars[fqn] = tuple(
            sorted(_scalar(fqn, k, v) for k, v in entry.items() if not _is_param_shaped(v))
        )
    return OptimizerStateDict(
        state={fqn: e for fqn, e in tensors.items() if e},
        param_to_group_meta=GroupMetaTable.from_leaves(
            (fqn, (hyper, scalars.get(fqn, ()))) for fqn, hyper in hyper_of.items()
        ),
    )


def _is_param_shaped(value: Any) -> bool:
    """A DTensor, or a plain tensor that is not 0-d: state that lives in ``state[fqn]``."""
    return isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.dim() > 0)


def _scalar(fqn: str, key: str, value: Any) -> tuple[str, Any, str | None]:
    if isinstance(value, torch.Tensor):
        return key, value.item(), dtype_name(value.dtype)
    return key, to_plain(value, f"state[{fqn!r}][{key!r}]"), None


def to_torch_state_dict(sd: dict) -> dict:
    """fsdp_dtensor layout (format 3, 2 or 1) -> torch's unflattened optimizer state dict
    (parameter-shaped tensors shared, ``step`` a new 0-d tensor).

    Params whose hyperparameters are equal form one group, in first-seen order; groups that held
    equal hyperparameters in the original optimizer therefore merge, which torch's
    ``set_optimizer_state_dict`` accepts (it maps params by FQN). ``sd`` is not mutated.

    Args:
        sd: An fsdp_dtensor optimizer state dict, ``{"state": ..., "param_to_group_meta":
            ...}``: what [build_sharded_state_dict][mfsdp_optim.checkpoint.build_sharded_state_dict]
            returns, or what ``dcp.load`` left in it (the table as its tagged tuple), or format 2
            (a dict of leaves per FQN) or 0.1.0's format 1 (a hyperparameter dict per FQN,
            ``step`` inside ``state[fqn]``).

    Returns:
        ``{"state": {fqn: {key: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}``,
            the layout ``set_optimizer_state_dict`` and ``dcp.load`` of a torch checkpoint use.

    Raises:
        ValueError: ``sd`` does not have exactly the keys ``state`` and
            ``param_to_group_meta``, or a ``param_to_group_meta`` leaf is malformed (the
            message names its FQN).
        TypeError: A hyperparameter a checkpoint cannot hold as plain data.
    """
    if not isinstance(sd, dict) or set(sd) != {"state", "param_to_group_meta"}:
        got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"expected {{'state': ..., 'param_to_group_meta': ...}}, got {got}")
    sd = as_format1(sd)
    groups: dict[tuple, dict] = {}
    for fqn, hyper in sd["param_to_group_meta"].items():
        key = to_plain(tuple(sorted(hyper.items())), f"param_to_group_meta[{fqn!r}]")
        if key not in groups:
            groups[key] = {**hyper, "params": []}
        groups[key]["params"].append(fqn)
    return {
        "state": {fqn: dict(entry) for fqn, entry in sd["state"].items()},
        "param_groups": list(groups.values()),
    }
