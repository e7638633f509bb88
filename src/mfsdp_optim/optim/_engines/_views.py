"""The base optimizer's step on local shards, with its param lists and state left stock.

Map: ``local_shard_view(optimizer, slots)``, a context manager: for one ``step()`` the group
``params`` lists (and lists beside them, ``_infra.group_lists``) are refilled in place with the
held slots' local tensors and ``optimizer.state`` is a view keyed by them (zero copy); on exit
the lists and the state mapping are put back and every value the step created or replaced is
made stock (``_infra.placement.as_stock_value``: parameter-shaped tensors as DTensors, no copy).
The rules: docs/concepts.md, "The base optimizer stays stock" and "Lists kept beside the param
groups".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from ..._infra.group_lists import aligned_lists
from ..._infra.placement import as_stock_value
from ._slots import Slot

__all__ = ["local_shard_view"]


def _local_value(value: object) -> object:
    return value._local_tensor if isinstance(value, DTensor) else value


@contextmanager
def local_shard_view(
    optimizer: torch.optim.Optimizer, slots: Sequence[Slot]
) -> Iterator[list[tuple[DTensor, torch.Tensor]]]:
    """Show ``optimizer`` the local shards of the held ``slots`` (see the module docstring);
    yields the ``(param, local)`` pairs it shows."""
    groups = optimizer.param_groups
    saved = [list(g["params"]) for g in groups]
    shown: list[list[torch.Tensor]] = [[] for _ in groups]
    pairs: list[tuple[DTensor, torch.Tensor]] = []
    beside = [lists for _, lists in aligned_lists(optimizer)]
    shown_beside: list[list[list]] = [[[] for _ in groups] for _ in beside]
    position = [0] * len(groups)  # slots come in group order: a slot's index in its group
    for s in slots:
        gi = s.group_index
        j = position[gi]
        position[gi] = j + 1
        if s.held:
            local = s.param._local_tensor
            shown[gi].append(local)
            pairs.append((s.param, local))
            for lists, out in zip(beside, shown_beside, strict=True):
                out[gi].append(_local_value(lists[gi][j]))
    saved_beside = [[list(lst) for lst in lists] for lists in beside]
    state = optimizer.state
    view: defaultdict[torch.Tensor, dict] = defaultdict(dict)
    for p, local in pairs:
        entry = state.get(p)
        if entry:
            view[local] = {k: _local_value(v) for k, v in entry.items()}
    try:
        for g, params in zip(groups, shown, strict=True):
            g["params"][:] = params
        _refill(beside, shown_beside)
        optimizer.state = view
        yield pairs
    finally:
        for g, params in zip(groups, saved, strict=True):
            g["params"][:] = params
        _refill(beside, saved_beside)
        optimizer.state = state
        _write_back(state, view, pairs)


def _refill(lists: list[list[list]], contents: list[list[list]]) -> None:
    for per_group, new in zip(lists, contents, strict=True):
        for lst, entries in zip(per_group, new, strict=True):
            lst[:] = entries


def _write_back(state: dict, view: dict, pairs: list[tuple[DTensor, torch.Tensor]]) -> None:
    """Put what the step created or replaced in ``view`` into the stock ``state``."""
    for p, local in pairs:
        new = view.get(local)
        if new is None:
            continue
        old = state.get(p)
        if old is None:
            state[p] = {k: as_stock_value(k, v, p, local) for k, v in new.items()}
            continue
        for k, v in new.items():
            ov = old.get(k)
            if ov is v or (isinstance(ov, DTensor) and ov._local_tensor is v):
                continue
            old[k] = as_stock_value(k, v, p, local)
        if len(old) != len(new):
            for k in [k for k in old if k not in new]:
                del old[k]
