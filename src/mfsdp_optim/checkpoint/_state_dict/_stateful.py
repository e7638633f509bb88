"""A ``torch.distributed.checkpoint`` ``Stateful`` around a FullyShardedOptimizer-like object."""

from __future__ import annotations

import copy
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["OptimizerStateful"]


class OptimizerStateful(Stateful):
    """Pass ``{"optimizer": OptimizerStateful(opt)}`` to ``dcp.save`` / ``dcp.load`` directly.

    ``optimizer`` needs ``sharded_state_dict(is_loading=...)`` and ``load_state_dict(sd)`` (a
    ``FullyShardedOptimizer``). Its grad scaler (``grad_scaler=``, or the object's own
    ``grad_scaler`` attribute) travels along under ``"grad_scaler"`` when there is one.

    DCP calls ``state_dict()`` both to save and to get the load target, so it cannot tell the two
    apart: with ``materialize=True`` (default) it always materialises state first, so loading
    works, and a save through it writes (zero, ``step`` 0) state for params that never stepped.
    Pass ``materialize=False`` for a save-only adapter that writes exactly the live state.

    Layout:

    ```python
    {"optimizer": {"state": ..., "param_to_group_meta": ...},
     "grad_scaler": {"scale": 65536.0, ...}}          # only with a grad scaler
    ```

    Args:
        optimizer: Needs ``sharded_state_dict(is_loading=...)`` and ``load_state_dict(sd)`` (a
            [FullyShardedOptimizer][mfsdp_optim.optim._optimizer.FullyShardedOptimizer]).
        grad_scaler: The grad scaler to save and load along (default: the optimizer's own
            ``grad_scaler`` attribute, if any).
        materialize: Materialise state before every ``state_dict()`` (needed to load).
    """

    def __init__(self, optimizer: Any, *, grad_scaler: Any = None, materialize: bool = True):
        self.optimizer = optimizer
        self.grad_scaler = (
            grad_scaler if grad_scaler is not None else getattr(optimizer, "grad_scaler", None)
        )
        self.materialize = materialize

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "optimizer": self.optimizer.sharded_state_dict(is_loading=self.materialize)
        }
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scaler_state = state_dict.get("grad_scaler")
        if self.grad_scaler is not None:
            if scaler_state is None:
                raise ValueError(
                    "the checkpoint holds no 'grad_scaler' state but this optimizer "
                    "has a grad scaler"
                )
            copy.deepcopy(self.grad_scaler).load_state_dict(scaler_state)  # validate first
        elif scaler_state is not None:
            raise ValueError(
                "the checkpoint holds 'grad_scaler' state but this optimizer has no "
                "grad scaler; pass grad_scaler="
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(scaler_state)
