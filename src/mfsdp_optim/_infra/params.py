"""How the wrapper describes its parameters to the checkpoint layer.

The checkpoint layer works on (base optimizer, records) and never on the wrapper itself, so it
serves any optimizer over DTensor params: one whose params are the DTensors themselves, one that
the wrapper feeds local-shard aliases, and ranks where a param was filtered out of the base
optimizer (empty local shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ParamRecord", "strip_compile_prefix"]

_COMPILE_PREFIX = "_orig_mod"


@dataclass(frozen=True)
class ParamRecord:
    """One trainable parameter as the checkpoint layer sees it: what
    [build_sharded_state_dict][mfsdp_optim.checkpoint.build_sharded_state_dict] and
    [load_sharded_state_dict][mfsdp_optim.checkpoint.load_sharded_state_dict] take, one per
    trainable param (``FullyShardedOptimizer`` builds them itself).

    Attributes:
        fqn: The parameter's fully qualified name, as ``model.named_parameters()`` gives it
            (unique across model chunks); the key of its entries in the state dict.
        param: The model's DTensor parameter: its mesh, placements and global shape define the
            layout of every state tensor of the same shape.
        opt_param: The tensor object the base optimizer holds for it on this rank (the DTensor
            itself, or a plain local-shard alias that shares its storage), or None when this
            rank's base optimizer does not hold it (a param whose local shard is empty, left
            out of the base optimizer).
    """

    fqn: str
    param: DTensor
    opt_param: torch.Tensor | None


def strip_compile_prefix(name: str) -> str:
    """``name`` without ``torch.compile``'s ``_orig_mod`` component (stock DCP's FQN)."""
    return ".".join(part for part in name.split(".") if part != _COMPILE_PREFIX)
