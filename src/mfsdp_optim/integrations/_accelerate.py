"""HF accelerate 1.15: shard with accelerate's FSDP2 plugin, wrap, then ``prepare()`` (the
contract: ``accelerate.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ..optim import FullyShardedOptimizer
from ._lazy import TRAINERS_EXTRA, require

_WHO = "mfsdp_optim.integrations.accelerate"
require("accelerate", _WHO, TRAINERS_EXTRA)

from accelerate.utils import fsdp2_prepare_model  # noqa: E402

__all__ = ["prepare", "shard", "unwrap"]

_NOT_FSDP2 = (
    "accelerate's FSDP2 path is not active here (distributed_type={kind}, fsdp plugin "
    "version {version}). Build the Accelerator with fsdp_plugin=FullyShardedDataParallelPlugin("
    "fsdp_version=2) and run on GPUs (accelerate launch, or torchrun: LOCAL_RANK must be set): "
    "accelerate engages FSDP2 only on CUDA-like devices; on CPU it trains DDP over plain params, "
    "which FullyShardedOptimizer refuses."
)


def _check_fsdp2(accelerator: Any) -> None:
    if not accelerator.is_fsdp2:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", None)
        raise RuntimeError(_NOT_FSDP2.format(kind=accelerator.distributed_type, version=version))


def shard(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Apply ``fully_shard`` to ``model`` as ``accelerator.prepare()`` would (accelerate's own
    ``fsdp2_prepare_model``: the plugin's auto-wrap policy, mixed precision, resharding and
    offload), so that the optimizer can be built over the sharded (DTensor) params.

    Args:
        accelerator: An ``Accelerator`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)``.
        model: The model, not yet sharded.

    Returns:
        The sharded model (the same module, sharded in place, or what accelerate returns).
    """
    _check_fsdp2(accelerator)
    return fsdp2_prepare_model(accelerator, model)


def prepare(
    accelerator: Any, model: torch.nn.Module, optimizer: FullyShardedOptimizer, *others: Any
) -> tuple[Any, ...]:
    """``accelerator.prepare(model, optimizer, *others)`` for a wrapper, in the one order that
    keeps its params: ``shard()`` (or ``fully_shard``) first, then the wrapper over the sharded
    model's params, then this. Refused, with what to change: a CPU or non-FSDP2 accelerator, a
    model that is not sharded yet, an optimizer that is not a ``FullyShardedOptimizer`` over the
    model's params, and ``mixed_precision="fp16"`` (accelerate's scaler would unscale the grads
    before the wrapper; use bf16, or the wrapper's own ``DynamicGradScaler``).

    Args:
        accelerator: An ``Accelerator`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)``.
        model: The model, sharded by ``shard()``.
        optimizer: The wrapper over the sharded model's params.
        *others: Further objects for ``accelerator.prepare`` (dataloaders, schedulers).

    Returns:
        What ``accelerator.prepare`` returns: the model, then accelerate's optimizer (its
        ``step()`` returns None: read the step's norm with ``unwrap(optimizer).last_grad_norm``),
        then the others.
    """
    _check_fsdp2(accelerator)
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError(
            f"the model ({type(model).__name__}) is not sharded: call model = shard(accelerator, "
            "model) first, build the base optimizer over its params, wrap it, then prepare(); "
            "a wrapper built before sharding holds plain params, which it refuses"
        )
    if not isinstance(optimizer, FullyShardedOptimizer):
        raise TypeError(
            f"prepare() takes the FullyShardedOptimizer, got {type(optimizer).__name__}: wrap "
            "the base optimizer before accelerate prepares it (an optimizer accelerate has "
            "prepared steps itself and would bypass the wrapper)"
        )
    if accelerator.scaler is not None:
        raise ValueError(
            "Accelerator(mixed_precision='fp16') unscales and checks the grads with torch's "
            "GradScaler before the wrapper's step: use mixed_precision='bf16', or no mixed "
            "precision and FullyShardedOptimizer(..., grad_scaler=DynamicGradScaler())"
        )
    _check_params(model, optimizer)
    prepared = accelerator.prepare(model, optimizer, *others)
    _check_params(prepared[0], optimizer)  # accelerate swapped them out and back
    if unwrap(prepared[1]) is not optimizer:
        raise RuntimeError(
            "accelerate's prepared optimizer does not step this wrapper: file an issue with "
            "the accelerate version"
        )
    optimizer.invalidate_caches()  # accelerate reloaded the state dict for device placement
    return tuple(prepared)


def _check_params(model: torch.nn.Module, optimizer: FullyShardedOptimizer) -> None:
    own = {id(p) for p in model.parameters()}
    strays = [
        i
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        if id(p) not in own
    ]
    if strays:
        raise ValueError(
            f"{len(strays)} of the optimizer's params (positions {strays[:8]}) are not the "
            "sharded model's: build the base optimizer over model.parameters() after "
            "shard(accelerator, model), then wrap it"
        )


def unwrap(optimizer: Any) -> FullyShardedOptimizer:
    """The ``FullyShardedOptimizer`` inside accelerate's (or Lightning Fabric's) optimizer
    wrappers; its ``last_grad_norm``, ``last_update_successful``, ``last_num_zeros`` and
    ``grad_norms`` hold the last step.

    Args:
        optimizer: What ``prepare()`` returned (an ``AcceleratedOptimizer``), or the wrapper.

    Returns:
        The wrapper.
    """
    seen = optimizer
    for _ in range(8):  # accelerate keeps its inner optimizer as .optimizer, Fabric as ._optimizer
        inner = vars(seen).get("optimizer", vars(seen).get("_optimizer"))
        if not isinstance(inner, torch.optim.Optimizer):
            break
        seen = inner
    if isinstance(seen, FullyShardedOptimizer):
        return seen
    raise TypeError(f"no FullyShardedOptimizer inside {type(optimizer).__name__}")
