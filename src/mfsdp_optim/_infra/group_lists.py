"""Lists that some optimizers keep beside ``param_groups``, position by position with its params.

Map: ``ALIGNED_ATTRS`` the attributes looked for (apex FusedAdam's ``param_groups_master``);
``aligned_lists`` those an optimizer holds, checked to have one entry per param of each group
(``AlignmentError`` otherwise). Whoever shows an optimizer other params
(``optim._engines._views``, the checkpoint layer's scratch step) refills these lists in place and
restores them; why: docs/concepts.md, "Lists kept beside the param groups".
"""

from __future__ import annotations

import torch

__all__ = ["ALIGNED_ATTRS", "AlignmentError", "aligned_lists"]

# attributes holding per-group lists aligned with param_groups (apex FusedAdam's master weights)
ALIGNED_ATTRS = ("param_groups_master",)


class AlignmentError(ValueError):
    """A per-group list beside ``param_groups`` no longer matches the groups' params."""


def aligned_lists(optimizer: torch.optim.Optimizer) -> list[tuple[str, list[list]]]:
    """``(attribute, per-group params lists)`` for every attribute in ``ALIGNED_ATTRS`` that
    ``optimizer`` has aligned with its groups; ``[]`` when it has none (every torch optimizer).

    Raises:
        AlignmentError: an attribute is present and holds tensors but does not have one dict per
            param group with one entry per param (apex's ``add_param_group`` does not extend
            ``param_groups_master``): its step would pair params with the wrong masters.
    """
    out = []
    groups = optimizer.param_groups
    for attr in ALIGNED_ATTRS:
        value = getattr(optimizer, attr, None)
        if value is None:
            continue
        lists = _group_params(value)
        if lists is None:
            continue  # not a per-group list of param lists: nothing apex-like to align
        if _matches(lists, groups):
            out.append((attr, lists))
        elif any(isinstance(t, torch.Tensor) for lst in lists for t in lst):
            raise AlignmentError(
                f"{type(optimizer).__name__}.{attr} does not match param_groups (it needs one "
                "dict per group whose 'params' list has one entry per param of that group); "
                "rebuild the optimizer instead of calling add_param_group, so its master "
                "weights pair with the right params"
            )
    return out


def _matches(lists: list[list], groups: list[dict]) -> bool:
    return len(lists) == len(groups) and all(
        len(lst) == len(g["params"]) for lst, g in zip(lists, groups, strict=True)
    )


def _group_params(value: object) -> list[list] | None:
    if not isinstance(value, list):
        return None
    lists = []
    for entry in value:
        params = entry.get("params") if isinstance(entry, dict) else None
        if not isinstance(params, list):
            return None
        lists.append(params)
    return lists
