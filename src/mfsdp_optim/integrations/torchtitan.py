"""torchtitan 0.3 (``pip install 'mfsdp-optim[trainers]'``, then ``pip install --no-deps
torchtitan==0.3.0``): docs/trainers.md has the recipe.

- ``FullyShardedOptimizersContainer``: torchtitan's ``OptimizersContainer`` (built by its
  ``Config.build(model_parts=...)`` hook, ``"Adam"``, ``"AdamW"`` or ``"Muon"`` per param group)
  whose ``step()`` is one ``FullyShardedOptimizer`` step over all its base optimizers. Its
  ``state_dict()`` is the stock container's, so ``CheckpointManager`` works unchanged and
  checkpoints move both ways between the stock container and this one.
- ``FullyShardedTrainer``: torchtitan's ``Trainer`` whose ``train_step`` neither computes a
  norm nor clips (the wrapper clips once, to ``training.max_norm``) and logs the wrapper's
  pre-clip global norm. Under the stock ``Trainer`` the container refuses to step (torchtitan
  would already have clipped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:
    from ._torchtitan import FullyShardedOptimizersContainer
    from ._torchtitan_trainer import FullyShardedTrainer

__all__ = ["FullyShardedOptimizersContainer", "FullyShardedTrainer"]

__getattr__ = lazy_names(
    __name__,
    {
        "FullyShardedOptimizersContainer": "._torchtitan",
        "FullyShardedTrainer": "._torchtitan_trainer",
    },
)
