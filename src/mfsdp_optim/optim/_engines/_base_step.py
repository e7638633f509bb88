"""Running a base optimizer's own ``step()`` on the local shards: ``base_step``.

The engine ``_route`` picks as ``BASE``: the local-shard view (``_views``) shows the optimizer
its params' local shards with their work grads bound, torch's global step hooks are held back
for the call (the wrapper fires them once per ``step()``), and a folded clip or a device skip is
handed over as ``grad_scale``/``found_inf``, the way ``torch.amp.GradScaler`` hands them to
fused optimizers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import optimizer as _torch_optim

from ._slots import Slot
from ._views import local_shard_view

__all__ = ["base_step", "global_hooks_held_back"]


@contextmanager
def global_hooks_held_back() -> Iterator[None]:
    """torch's global optimizer step hooks, emptied for the duration (the same dicts)."""
    dicts: list[Any] = [
        _torch_optim._global_optimizer_pre_hooks,
        _torch_optim._global_optimizer_post_hooks,
    ]
    held = [(d, list(d.items())) for d in dicts]
    for d, _ in held:
        d.clear()
    try:
        yield
    finally:
        for d, items in held:
            d.update(items)


def base_step(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[Slot],
    *,
    decoupled: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``optimizer.step()`` on the local shards of the held slots, their work grads bound.

    ``grad_scale``/``found_inf``: set on the optimizer for the call, the way
    ``torch.amp.GradScaler`` hands them to fused optimizers."""
    with local_shard_view(optimizer, slots) as pairs:
        bound: list[torch.Tensor] = []
        for s, (_, local) in zip((s for s in slots if s.held), pairs, strict=True):
            wg = s.work_grad
            if wg is None:
                continue
            lg = wg._local_tensor
            if decoupled:
                local.decoupled_grad = lg  # type: ignore[attr-defined]  # TE's attribute
            else:
                if lg.dtype != local.dtype:  # a precision-aware optimizer takes low precision
                    local.grad_dtype = None
                local.grad = lg
            bound.append(local)
        try:
            if grad_scale is not None:
                optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            if found_inf is not None:
                optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            with global_hooks_held_back():
                optimizer.step()
        finally:
            if grad_scale is not None:
                del optimizer.grad_scale  # type: ignore[attr-defined]
            if found_inf is not None:
                del optimizer.found_inf  # type: ignore[attr-defined]
            for a in bound:
                if decoupled:
                    a.decoupled_grad = None  # type: ignore[attr-defined]  # TE's attribute
                else:
                    a.grad = None
