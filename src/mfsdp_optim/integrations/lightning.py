"""Lightning 2.6 (``pip install 'mfsdp-optim[trainers]'``): docs/trainers.md has the recipes.

- ``GradNormCallback``: for ``lightning.pytorch.Trainer`` (``ModelParallelStrategy``, the wrapper
  returned by ``configure_optimizers``): logs each step's pre-clip global norm, and refuses
  ``Trainer(gradient_clip_val=...)`` before the first step (Lightning would clip before the
  wrapper reads the grads; clip with ``OptimizerConfig(clip_grad=...)``).
- Fabric needs nothing more: ``fabric.setup_optimizers(wrapper)`` returns an optimizer whose
  ``step()`` returns the wrapper's ``(update_successful, grad_norm, num_zeros)``; Fabric never
  clips unless the loop calls ``fabric.clip_gradients``, which the wrapper's ``clip_grad``
  replaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:
    from ._lightning import GradNormCallback

__all__ = ["GradNormCallback"]

__getattr__ = lazy_names(__name__, {"GradNormCallback": "._lightning"})
