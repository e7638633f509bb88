"""Conversions between the fsdp_dtensor layout and torch's ``get_optimizer_state_dict`` layout.

torch (unflattened, ``StateDictOptions(flatten_optimizer_state_dict=False)``)::

    {"state": {fqn: {"exp_avg": DTensor, "step": tensor(3.)}},
     "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), ..., "params": [fqn, fqn, ...]}]}

fsdp_dtensor::

    {"state": {fqn: {"exp_avg": DTensor, "step": tensor(3.)}},
     "param_to_group_meta": {fqn: {"lr": 0.01, "betas": (0.9, 0.999), ...}}}

The state tensors are shared, never copied; the inputs are never mutated.
"""

from __future__ import annotations

from typing import Any

from ._values import EXCLUDED_GROUP_KEYS, to_plain

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]


def from_torch_state_dict(osd: dict) -> dict:
    """torch's unflattened optimizer state dict -> fsdp_dtensor layout (tensors shared)."""
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
    meta: dict[str, dict[str, Any]] = {}
    for gi, group in enumerate(osd["param_groups"]):
        hyper = {k: v for k, v in group.items() if k not in EXCLUDED_GROUP_KEYS}
        for fqn in group["params"]:
            if not isinstance(fqn, str):
                raise ValueError(
                    f"param_groups[{gi}]['params'] holds {type(fqn).__name__} ids, not FQNs: pass "
                    "the state dict of get_optimizer_state_dict, not optimizer.state_dict()"
                )
            if fqn in meta:
                raise ValueError(f"{fqn!r} appears in more than one param group")
            meta[fqn] = dict(hyper)
    return {"state": {fqn: dict(entry) for fqn, entry in state.items()},
            "param_to_group_meta": meta}


def to_torch_state_dict(sd: dict) -> dict:
    """fsdp_dtensor layout -> torch's unflattened optimizer state dict (tensors shared).

    Params whose hyperparameters are equal form one group, in first-seen order; groups that held
    equal hyperparameters in the original optimizer therefore merge, which torch's
    ``set_optimizer_state_dict`` accepts (it maps params by FQN).
    """
    if not isinstance(sd, dict) or set(sd) != {"state", "param_to_group_meta"}:
        got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"expected {{'state': ..., 'param_to_group_meta': ...}}, got {got}")
    groups: dict[tuple, dict] = {}
    for fqn, hyper in sd["param_to_group_meta"].items():
        key = to_plain(tuple(sorted(hyper.items())), f"param_to_group_meta[{fqn!r}]")
        if key not in groups:
            groups[key] = {**hyper, "params": []}
        groups[key]["params"].append(fqn)
    return {"state": {fqn: dict(entry) for fqn, entry in sd["state"].items()},
            "param_groups": list(groups.values())}
