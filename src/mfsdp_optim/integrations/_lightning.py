"""Lightning 2.6: the callback that logs the wrapper's pre-clip norm and refuses Lightning's own
clipping (the contract: ``lightning.py``)."""

from __future__ import annotations

from typing import Any

from ..optim import FullyShardedOptimizer
from ._lazy import TRAINERS_EXTRA, require

require("lightning.pytorch", "mfsdp_optim.integrations.lightning", TRAINERS_EXTRA)

from lightning.pytorch import Callback  # noqa: E402

__all__ = ["GradNormCallback"]


class GradNormCallback(Callback):
    """Logs each [FullyShardedOptimizer][mfsdp_optim.optim.FullyShardedOptimizer] step's
    pre-clip global grad norm, and refuses a ``Trainer`` that would clip before the wrapper.

    Lightning clips inside the step's closure, before the wrapper reads the grads: with
    ``Trainer(gradient_clip_val=...)`` set, the wrapper would report (and log) the norm of
    already clipped grads. ``on_fit_start`` (every rank, before the first step) raises a
    ``ValueError`` then: clip in the wrapper instead (``OptimizerConfig(clip_grad=...)``).

    Args:
        name: The logged metric (``name`` for the first wrapper, ``name/<i>`` for the i-th of
            several optimizers from ``configure_optimizers``).
        per_optimizer: Also log each base optimizer's norm (``wrapper.grad_norms``) as
            ``<name>/base<j>``.
        prog_bar: Show the norm in the progress bar.
    """

    def __init__(
        self, name: str = "grad_norm", *, per_optimizer: bool = False, prog_bar: bool = False
    ) -> None:
        self.name, self.per_optimizer, self.prog_bar = name, per_optimizer, prog_bar
        self._wrappers: list[FullyShardedOptimizer] = []
        self._stepped: set[int] = set()
        self._handles: list[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._wrappers = [o for o in trainer.optimizers if isinstance(o, FullyShardedOptimizer)]
        if not self._wrappers:
            raise TypeError(
                "GradNormCallback logs a FullyShardedOptimizer's norm, but configure_optimizers() "
                f"returned {[type(o).__name__ for o in trainer.optimizers]}: return the wrapper, "
                "FullyShardedOptimizer(torch.optim.AdamW(...), OptimizerConfig(clip_grad=...), "
                "model_chunks=[self])"
            )
        clip = trainer.gradient_clip_val
        if clip:
            raise ValueError(
                f"Trainer(gradient_clip_val={clip}) makes Lightning clip the grads before "
                "FullyShardedOptimizer.step() reads them, so the logged norm would be the clipped "
                "one. Pass Trainer(gradient_clip_val=None) and clip in the wrapper: "
                f"OptimizerConfig(clip_grad={clip}) (it clips by the exact global norm, once)."
            )
        for i, wrapper in enumerate(self._wrappers):
            self._handles.append(wrapper.register_step_post_hook(self._hook(i)))

    def _hook(self, index: int):
        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._stepped.add(index)

        return stepped

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for i in sorted(self._stepped):  # only the wrappers that stepped in this batch
            wrapper = self._wrappers[i]
            name = self.name if i == 0 else f"{self.name}/{i}"
            metrics = {name: wrapper.last_grad_norm}
            if self.per_optimizer:
                metrics.update({f"{name}/base{j}": n for j, n in enumerate(wrapper.grad_norms)})
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=self.prog_bar)
        self._stepped.clear()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
