"""Plain values: hyperparameters and scalar state as checkpoint-safe Python data.

A checkpoint of this package carries no pickled code of ours. Hyperparameters are stored as
``bool``, ``int``, ``float``, ``str``, ``None`` or tuples of those; a tensor hyperparameter (a
tensor ``lr`` of a capturable or fused optimizer) is stored as the Python number it holds and turned
back into a tensor of the live dtype and device on load.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "EXCLUDED_GROUP_KEYS",
    "PlainValueError",
    "dtype_from_name",
    "dtype_name",
    "group_meta",
    "restore_like",
    "to_plain",
]

# per-param keys of a torch param group: not hyperparameters
EXCLUDED_GROUP_KEYS = frozenset({"params", "param_names"})

_SCALARS = (bool, int, float, str, type(None))


class PlainValueError(TypeError):
    """A hyperparameter or state value that a checkpoint cannot hold as plain data."""


def to_plain(value: Any, where: str) -> Any:
    """``value`` as plain Python data; one-element tensors become numbers, lists become tuples."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PlainValueError(
                f"{where} is a tensor of shape {tuple(value.shape)}; only one-element tensor "
                "hyperparameters can be stored as plain numbers"
            )
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(to_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise PlainValueError(
        f"{where} is a {type(value).__name__}; checkpoints hold only bool, int, float, str, None "
        "and tuples of those. Store a plain value in the param group instead."
    )


def restore_like(live: Any, saved: Any) -> Any:
    """``saved`` in the form of ``live``: a tensor hyperparameter stays a (new) tensor of the live
    dtype, device and shape (apex's capturable FusedAdam keeps its group ``step`` and ``lr`` as
    shape ``[1]``, torch's as 0-d), a list stays a list, a tuple of tensors a tuple of tensors."""
    if isinstance(live, torch.Tensor) and not isinstance(saved, torch.Tensor):
        out = torch.tensor(saved, dtype=live.dtype, device=live.device)
        return out.reshape(live.shape) if live.numel() == 1 else out
    if (
        isinstance(live, (tuple, list))
        and isinstance(saved, (tuple, list))
        and len(live) == len(saved)
    ):
        return type(live)(restore_like(a, b) for a, b in zip(live, saved, strict=True))
    return saved


def group_meta(group: dict, where: str) -> dict[str, Any]:
    """The hyperparameters of a param group (every key but the per-param ones) as plain data."""
    return {
        k: to_plain(v, f"{where}[{k!r}]") for k, v in group.items() if k not in EXCLUDED_GROUP_KEYS
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype
