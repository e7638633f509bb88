"""torchtitan 0.3: the trainer whose ``train_step`` lets the container's wrapper clip once and
hands the wrapper's pre-clip norm to the metrics (the contract: ``torchtitan.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from ._lazy import require
from ._torchtitan import INSTALL, FullyShardedOptimizersContainer, as_clip

__all__ = ["FullyShardedTrainer"]


def _trainer_class() -> type:
    trainer = require(
        "torchtitan.trainer", "mfsdp_optim.integrations.torchtitan.FullyShardedTrainer", INSTALL
    )
    return trainer.Trainer


_Trainer: Any = _trainer_class()


class FullyShardedTrainer(_Trainer):
    """torchtitan's ``Trainer`` with the clip in the optimizer step: ``train_step`` runs
    torchtitan's own code, except that its ``clip_grad_norm_`` neither computes a norm nor
    clips; the container's wrapper clips once, to ``training.max_norm``, and the norm the
    metrics log is the wrapper's pre-clip global norm.

    Built as ``Trainer`` is, from its ``Config``: the same fields as ``Trainer.Config``; its
    ``optimizer`` must be a ``FullyShardedOptimizersContainer.Config`` (its ``clip_grad`` is set
    to ``training.max_norm``).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_Trainer.Config):
        """``Trainer.Config``; the optimizer config's ``clip_grad`` is ``training.max_norm``."""

        def __post_init__(self) -> None:
            _Trainer.Config.__post_init__(self)
            _hand_max_norm_to_wrapper(self)

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """torchtitan's ``train_step``, its clip done by the optimizers' step.

        Args:
            data_iterator: As for ``Trainer.train_step``.
        """
        with _clip_in_step(self.optimizers):
            super().train_step(data_iterator)


def _hand_max_norm_to_wrapper(config: Any) -> None:
    """``config.optimizer`` becomes a copy whose ``clip_grad`` is ``training.max_norm``."""
    config.optimizer = _clip_by_max_norm(config.optimizer, config.training.max_norm)


def _clip_by_max_norm(optimizer: Any, max_norm: float) -> Any:
    """``optimizer`` (a ``FullyShardedOptimizersContainer.Config``) with ``clip_grad`` set to
    torchtitan's ``max_norm``; a copy, the config handed in is left as it was."""
    if not isinstance(optimizer, FullyShardedOptimizersContainer.Config):
        raise TypeError(
            "FullyShardedTrainer.Config needs optimizer=FullyShardedOptimizersContainer.Config"
            f"(...) (the container whose step clips), got {type(optimizer).__qualname__}"
        )
    clip = as_clip(max_norm)
    if optimizer.clip_grad is not None and float(optimizer.clip_grad) != clip:
        raise ValueError(
            f"the optimizer config's clip_grad={optimizer.clip_grad} differs from "
            f"training.max_norm={max_norm}: under FullyShardedTrainer the wrapper clips to "
            "training.max_norm; leave clip_grad unset (None)"
        )
    return dataclasses.replace(optimizer, clip_grad=clip)


@contextlib.contextmanager
def _clip_in_step(container: Any) -> Iterator[None]:
    """While torchtitan's ``train_step`` runs, its ``dist_utils.clip_grad_norm_`` hands back
    the container's after-step norm instead of computing a norm and clipping."""
    if not isinstance(container, FullyShardedOptimizersContainer):
        raise TypeError(
            "FullyShardedTrainer needs a FullyShardedOptimizersContainer (optimizer="
            f"FullyShardedOptimizersContainer.Config(...)), got {type(container).__qualname__}"
        )
    from torchtitan.distributed import utils as dist_utils

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any):
        return container.grad_norm_after_step(max_norm)

    stock = dist_utils.clip_grad_norm_
    dist_utils.clip_grad_norm_ = clip_grad_norm_
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = stock
