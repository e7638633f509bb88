"""torchtitan 0.3: the optimizers container whose step is one wrapper step (the contract:
``torchtitan.py``); it needs only torchtitan's optimizer module, not its trainer."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..optim import FullyShardedOptimizer, OptimizerConfig
from ._lazy import TRAINERS_EXTRA, require

INSTALL = f"{TRAINERS_EXTRA}, then pip install --no-deps torchtitan==0.3.0"
require("torchtitan.components.optimizer", "mfsdp_optim.integrations.torchtitan", INSTALL)

from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402

__all__ = ["INSTALL", "FullyShardedOptimizersContainer", "as_clip"]


class FullyShardedOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose ``step()`` is one
    [FullyShardedOptimizer][mfsdp_optim.optim.FullyShardedOptimizer] step over all its base
    optimizers (one grad-stats collective, one clip by the global norm).

    The base optimizers are built by torchtitan's own code from ``Config.param_groups``
    (``"Adam"``, ``"AdamW"``, and ``"Muon"`` for ``torch.optim.Muon``), so ``state_dict()``,
    ``load_state_dict()``, the lr schedulers and ``CheckpointManager`` see what they see with
    the stock container, and checkpoints go both ways between the two.

    Args:
        config: The container's ``Config``: torchtitan's fields plus the wrapper's options.
        model_parts: The model parts (their ``named_parameters()`` name the params).

    Attributes:
        wrapper: The ``FullyShardedOptimizer`` over ``optimizers``; its ``last_grad_norm``,
            ``grad_norms`` and ``last_num_zeros`` hold the last step's statistics.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's optimizer config plus the wrapper's options.

        Attributes:
            clip_grad: The global norm the wrapper clips to. None (the default): under
                ``FullyShardedTrainer``, torchtitan's ``training.max_norm``; elsewhere no
                clipping.
            norm_type: The norm clipped by and reported.
            clip_scope: ``"global"`` or ``"per_optimizer"`` (``OptimizerConfig.clip_scope``).
            host_sync: False: the step returns 0-d device tensors and never waits for them.
            log_num_zeros_in_grad: Also count zero grad elements (``wrapper.last_num_zeros``).
        """

        clip_grad: float | None = None
        norm_type: float = 2.0
        clip_scope: str = "global"
        host_sync: bool = True
        log_num_zeros_in_grad: bool = False

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name == "Muon":
            return torch.optim.Muon
        if name == "DistMuon":
            raise ValueError(
                "FullyShardedOptimizersContainer steps torch.optim.Muon exactly on FSDP2 "
                "params itself: name the optimizer 'Muon', not 'DistMuon'"
            )
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        clip = config.clip_grad
        self.wrapper = FullyShardedOptimizer(
            list(self.optimizers),
            OptimizerConfig(
                clip_grad=0.0 if clip is None else clip,
                norm_type=config.norm_type,
                log_num_zeros_in_grad=config.log_num_zeros_in_grad,
                host_sync=config.host_sync,
                clip_scope=config.clip_scope,
            ),
            model_chunks=model_parts,
        )
        self._norm_out: torch.Tensor | None = None

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """One wrapper step over every base optimizer.

        Returns:
            The wrapper's ``(update_successful, grad_norm, num_zeros)``.
        """
        if closure is not None:
            raise ValueError("FullyShardedOptimizersContainer.step() takes no closure")
        if self._norm_out is None:
            _refuse_stock_train_step()
        out = self.wrapper.step()
        if self._norm_out is not None:
            norm = self.wrapper.last_grad_norm
            if isinstance(norm, torch.Tensor):
                self._norm_out.copy_(norm)
            else:
                self._norm_out.fill_(norm)
            self._norm_out = None
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapper.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        fresh = any(not o.state for o in self.optimizers)
        sd = super().state_dict()  # torchtitan creates missing state with a scratch base step
        if fresh:
            self.wrapper.invalidate_caches()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.wrapper.invalidate_caches()  # the base optimizers hold new state tensors

    def grad_norm_after_step(self, max_norm: float) -> torch.Tensor:
        """A 0-d float32 tensor that the next ``step()`` fills with its pre-clip global norm:
        what ``FullyShardedTrainer`` hands torchtitan's ``train_step`` instead of the norm of
        its own clip (which it only reads after the step).

        Args:
            max_norm: torchtitan's ``training.max_norm``; it must be the clip this container's
                wrapper applies.

        Returns:
            The tensor, NaN until the step.
        """
        clip = self.wrapper.config.clip_grad
        if as_clip(max_norm) != clip:
            raise ValueError(
                f"torchtitan's training.max_norm is {max_norm}, but this container clips to "
                f"{clip}: build the container through FullyShardedTrainer.Config (it hands "
                "training.max_norm to the wrapper) and do not change max_norm afterwards"
            )
        device = next(iter(self.wrapper.param_groups[0]["params"])).device
        self._norm_out = torch.full((), float("nan"), dtype=torch.float32, device=device)
        return self._norm_out


def as_clip(max_norm: float) -> float:
    """torchtitan's ``max_norm`` as the wrapper's ``clip_grad`` (inf: no clipping)."""
    return 0.0 if math.isinf(max_norm) else float(max_norm)


def _refuse_stock_train_step() -> None:
    """Raise when torchtitan's own ``Trainer.train_step`` is stepping this container: it has
    already clipped the grads and sends its own norm to the metrics."""
    trainer = sys.modules.get("torchtitan.trainer")
    if trainer is None:
        return
    code = trainer.Trainer.train_step.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            raise RuntimeError(
                "torchtitan's Trainer.train_step clipped the grads to training.max_norm before "
                "this FullyShardedOptimizersContainer's step (its metrics would get the norm of "
                "that clip, and the wrapper's norm would be the clipped one). Build the trainer "
                "as mfsdp_optim.integrations.torchtitan.FullyShardedTrainer (its Config in "
                "place of Trainer.Config): the wrapper then clips once, to training.max_norm, "
                "and the metrics get its pre-clip global norm."
            )
        frame = frame.f_back  # type: ignore[assignment]
