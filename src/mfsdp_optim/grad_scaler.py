"""Loss scalers for :class:`mfsdp_optim.FullyShardedOptimizer`.

A scaler owns one number, the loss scale, and how it evolves. It does not look at gradients:
the wrapper unscales them, and the stats layer decides ``found_inf`` with its one collective over
the grad-stats group, so every rank of that group hands the same ``found_inf`` to
:meth:`GradScaler.update` and every rank's scale evolves identically (unlike
``torch.amp.GradScaler``, which agrees on ``found_inf`` only over the first grad's mesh).

The scale lives in a 0-d float32 tensor; :meth:`GradScaler.scale_on` / :meth:`GradScaler.inv_scale_on`
hand out cached copies on the grads' device so unscaling never synchronises with the host.

``state_dict()`` holds plain Python numbers (no tensors), so it pickles, survives ``torch.save`` and
``torch.distributed.checkpoint`` as non-tensor data, and is identical on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["GradScaler", "ConstantGradScaler", "DynamicGradScaler"]


class GradScaler:
    """Base class: a loss scale with ``update(found_inf)`` and a state dict.

    Subclasses implement :meth:`update`, :meth:`state_dict` and :meth:`load_state_dict`; they
    change the scale only through :meth:`_set_scale`.
    """

    def __init__(self, initial_scale: float):
        initial_scale = float(initial_scale)
        if not (initial_scale > 0 and math.isfinite(initial_scale)):
            raise ValueError(f"initial_scale must be a finite number > 0, got {initial_scale!r}")
        self._scale_value = initial_scale
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- the scale -------------------------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        """The loss scale as a 0-d float32 CPU tensor."""
        return self.scale_on(torch.device("cpu"))

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a 0-d float32 CPU tensor (computed in float64, then rounded)."""
        return self.inv_scale_on(torch.device("cpu"))

    def scale_on(self, device: torch.device | str) -> torch.Tensor:
        return self._on(torch.device(device))[0]

    def inv_scale_on(self, device: torch.device | str) -> torch.Tensor:
        return self._on(torch.device(device))[1]

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self._cache.get(device)
        if pair is None:
            pair = (
                torch.tensor(self._scale_value, dtype=torch.float32, device=device),
                torch.tensor(1.0 / self._scale_value, dtype=torch.float32, device=device),
            )
            self._cache[device] = pair
        return pair

    def _set_scale(self, value: float) -> None:
        value = float(value)
        if value != self._scale_value:
            self._scale_value = value
            self._cache.clear()

    def get_scale(self) -> float:
        return self._scale_value

    # -- evolution and state -----------------------------------------------------------------
    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self._scale_value})"


class ConstantGradScaler(GradScaler):
    """A fixed loss scale. Steps with non-finite grads are still skipped (everywhere)."""

    def __init__(self, scale: float):
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale_value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        value = float(state_dict["scale"])
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"scale must be a finite number > 0, got {value!r}")
        self._set_scale(value)


class DynamicGradScaler(GradScaler):
    """A loss scale that backs off on overflow and grows after a run of clean steps.

    Megatron-Core's rule, keyword-only options:

    * a step with non-finite grads resets the growth tracker and spends one unit of
      ``hysteresis``; when none is left, ``scale = max(scale * backoff_factor, min_scale)``
      (the hysteresis stays spent, so further overflows back off at once);
    * a clean step counts towards ``growth_interval``; after that many in a row,
      ``scale *= growth_factor`` and the hysteresis is refilled.

    Every rank of the grad-stats group sees the same ``found_inf``, so the scale is identical on
    every rank after every step.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        *,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        super().__init__(initial_scale)
        min_scale = float(min_scale)
        if not (0 < min_scale <= float(initial_scale)):
            raise ValueError(
                f"min_scale must be > 0 and <= initial_scale ({initial_scale}), got {min_scale!r}"
            )
        if not float(growth_factor) > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < float(backoff_factor) < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if int(growth_interval) < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}")
        if int(hysteresis) < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis!r}")
        self.min_scale = min_scale
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._set_scale(max(self._scale_value * self.backoff_factor, self.min_scale))
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._set_scale(self._scale_value * self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale_value,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise ValueError(
                f"DynamicGradScaler state_dict is missing {sorted(missing)}; got keys "
                f"{sorted(state_dict)}"
            )
        value = float(state_dict["scale"])
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"scale must be a finite number > 0, got {value!r}")
        self._set_scale(value)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
