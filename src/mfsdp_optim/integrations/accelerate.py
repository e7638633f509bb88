"""HF accelerate 1.15 (``pip install 'mfsdp-optim[trainers]'``): docs/trainers.md has the recipe.

accelerate engages FSDP2 only on CUDA-like devices (on CPU it trains DDP over plain params), so
the recipe runs on GPUs; ``scripts/accelerate_gpu.py`` checks it against stock AdamW.

- ``shard(accelerator, model)``: ``fully_shard`` as ``prepare()`` would apply it (accelerate's
  FSDP2 plugin options), so that the optimizer can be built over DTensor params.
- ``prepare(accelerator, model, wrapper, *others)``: ``accelerator.prepare`` in the one order that
  works (shard, wrap, prepare), with a clear error for the others.
- ``unwrap(optimizer)``: the wrapper inside accelerate's optimizer, whose ``step()`` returns
  None: its ``last_grad_norm`` is the step's pre-clip global norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:
    from ._accelerate import prepare, shard, unwrap

__all__ = ["prepare", "shard", "unwrap"]

__getattr__ = lazy_names(__name__, dict.fromkeys(__all__, "._accelerate"))
