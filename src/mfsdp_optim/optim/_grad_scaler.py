"""Loss scalers for ``mfsdp_optim.FullyShardedOptimizer``.

Map: ``GradScaler`` the base (one loss scale in a 0-d float32 tensor; ``scale_on`` /
``inv_scale_on`` cached device copies; ``update(found_inf)`` from a bool or a 0-d bool tensor;
``state_dict`` plain numbers); ``ConstantGradScaler`` and ``DynamicGradScaler`` the two rules.
A scaler never looks at grads: ``found_inf`` comes from the stats layer's one collective, so
every rank's scale evolves alike. Why, and the device-side update: docs/concepts.md, "Loss
scalers".
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["GradScaler", "ConstantGradScaler", "DynamicGradScaler"]

# the scale AND its inverse stay normal float32 numbers: a scale outside this range overflows
# (every step skipped) or unscales to zero / subnormals
MIN_SCALE = float(torch.finfo(torch.float32).tiny)  # 2**-126
MAX_SCALE = 1.0 / MIN_SCALE  # 2**126 (its inverse is float32's smallest normal)
_RANGE = f"[2**-126, 2**126] (about [{MIN_SCALE:.3g}, {MAX_SCALE:.3g}])"


def _real(name: str, value: Any) -> float:
    """``value`` as a finite float, or a TypeError/ValueError that names ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (numbers.Real, torch.Tensor))
        or (isinstance(value, torch.Tensor) and value.numel() != 1)
    ):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {out!r}")
    return out


def _scale(name: str, value: Any) -> float:
    """A loss scale: finite, > 0, and within float32's normal range (with its inverse)."""
    try:
        out = _real(name, value)
    except ValueError:
        out = math.nan
    if not (out > 0 and math.isfinite(out)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not MIN_SCALE <= out <= MAX_SCALE:
        raise ValueError(
            f"{name} must be a finite number > 0 within float32's normal range {_RANGE}, got "
            f"{out!r}: float32 grads scaled by it overflow to inf (every step skipped) or "
            "unscale to zero. Typical scales are 2**8 .. 2**24."
        )
    return out


def _integer(name: str, value: Any, minimum: int) -> int:
    """An integer >= ``minimum`` (an integral float such as 2.0 passes), naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float)):
        raise TypeError(
            f"{name} must be an integer >= {minimum}, got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _state_keys(state_dict: Any, who: str, keys: set[str]) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"{who} state_dict must be a dict (from {who}.state_dict()), got "
            f"{type(state_dict).__name__}"
        )
    missing, extra = keys - set(state_dict), set(state_dict) - keys
    if missing:
        raise ValueError(
            f"{who} state_dict is missing {sorted(missing)}; got keys "
            f"{sorted(state_dict)}. Pass what {who}.state_dict() returned."
        )
    if extra:
        raise ValueError(
            f"{who} state_dict has unexpected keys {sorted(extra)} (expected "
            f"{sorted(keys)}): the state of another scaler class?"
        )


class GradScaler:
    """Base class: a loss scale with ``update(found_inf)`` and a state dict.

    Subclasses implement ``update()``, ``state_dict()`` and ``load_state_dict()``; they
    change the scale only through ``_set_scale()``.

    Args:
        initial_scale: The loss scale to start from.
    """

    def __init__(self, initial_scale: float):
        self._scale_value = _scale("initial_scale", initial_scale)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # device-held state (update() with a tensor): name -> 0-d tensor; the host fields are
        # stale while _device_stale is True
        self._device: dict[str, torch.Tensor] = {}
        self._device_stale = False

    def _host_fields(self) -> dict[str, Any]:
        """The state the device copy mirrors (subclasses add their trackers)."""
        return {"_scale_value": self._scale_value}

    def _to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The device copy of the state on ``device`` (made from the host fields, by fill
        kernels: no host-to-device copy)."""
        dev = self._device
        if not dev or dev["_scale_value"].device != device:
            self._pull()
            dev = self._device = {
                k: torch.full(
                    (),
                    v,
                    dtype=torch.float64 if isinstance(v, float) else torch.int64,
                    device=device,
                )
                for k, v in self._host_fields().items()
            }
        return dev

    def _pull(self) -> None:
        """Bring device-held state back to the host fields (a host read, only when stale)."""
        if self._device_stale:
            for k, t in self._device.items():
                setattr(self, k, t.item())
            self._device_stale = False

    def _device_updated(self) -> None:
        self._device_stale = True
        dev = self._device
        scale = dev["_scale_value"]
        # scale_on/inv_scale_on of this device follow without a host read; others re-derive.
        # Written into the tensors already there (the ones a captured step reads: a CUDA graph
        # keeps the addresses it saw), else made.
        pair = self._cache.get(scale.device)
        if pair is not None:
            pair[0].copy_(scale)  # float64 -> float32: the rounding of .to(torch.float32)
            pair[1].copy_(1.0 / scale)
        else:
            pair = (scale.to(torch.float32), (1.0 / scale).to(torch.float32))
        self._cache = {scale.device: pair}

    def device_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """The device tensors a captured step on ``device`` reads: the device copy of the host
        fields (empty until a device update made one) and the ``(scale, inv_scale)`` pair
        cached on ``device``, if any."""
        return [*self._device.values(), *self._cache.get(device, ())]

    def replayed_on(self, device: torch.device) -> None:
        """A captured step's replay on ``device`` ran the device update (what
        ``_device_updated`` records when it runs eagerly): the host fields are stale, the pairs
        cached on other devices too. Nothing to do before a device copy exists."""
        if self._device:
            self._device_stale = True
            pair = self._cache.get(device)
            self._cache = {device: pair} if pair is not None else {}

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
            self._pull()
            # fill kernels, not host-to-device copies (which wait for the stream: a sync)
            pair = (
                torch.full((), self._scale_value, dtype=torch.float32, device=device),
                torch.full((), 1.0 / self._scale_value, dtype=torch.float32, device=device),
            )
            self._cache[device] = pair
        return pair

    def _set_scale(self, value: float) -> None:
        self._device = {}  # a host-side change: the device copy is rebuilt when next needed
        value = float(value)
        if value != self._scale_value:
            self._scale_value = value
            self._cache.clear()

    def get_scale(self) -> float:
        self._pull()
        return self._scale_value

    def needs_unscale(self) -> bool:
        """Whether grads must be divided by the scale (False only for a known scale of 1),
        answered without a host read."""
        return True

    # -- evolution and state -----------------------------------------------------------------
    def update(self, found_inf: bool | torch.Tensor) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.get_scale()})"


class ConstantGradScaler(GradScaler):
    """A fixed loss scale. Steps with non-finite grads are still skipped (everywhere).

    Args:
        scale: The loss scale.
    """

    def __init__(self, scale: float):
        super().__init__(scale)

    def update(self, found_inf: bool | torch.Tensor) -> None:
        pass

    def needs_unscale(self) -> bool:
        return self._scale_value != 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale_value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s scale; validated first (nothing changes when refused)."""
        _state_keys(state_dict, "ConstantGradScaler", {"scale"})
        self._set_scale(_scale("scale", state_dict["scale"]))


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

    Args:
        initial_scale: The scale to start from.
        min_scale: The scale never backs off below this.
        growth_factor: The scale is multiplied by this after ``growth_interval`` clean steps.
        backoff_factor: The scale is multiplied by this on an overflow with no hysteresis left.
        growth_interval: Clean steps in a row before the scale grows.
        hysteresis: Overflows tolerated before the scale backs off.
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
        min_scale = _scale("min_scale", min_scale)
        if not min_scale <= self._scale_value:
            raise ValueError(
                f"min_scale must be > 0 and <= initial_scale ({self._scale_value}), got "
                f"{min_scale!r}"
            )
        growth_factor = _real("growth_factor", growth_factor)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r} (typically 2)")
        backoff_factor = _real("backoff_factor", backoff_factor)
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"backoff_factor must be in (0, 1), got {backoff_factor!r} (typically 0.5)"
            )
        self.min_scale = min_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = _integer("growth_interval", growth_interval, 1)
        self.hysteresis = _integer("hysteresis", hysteresis, 1)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def _host_fields(self) -> dict[str, Any]:
        return {
            "_scale_value": self._scale_value,
            "_growth_tracker": self._growth_tracker,
            "_hysteresis_tracker": self._hysteresis_tracker,
        }

    def update(self, found_inf: bool | torch.Tensor) -> None:
        if isinstance(found_inf, torch.Tensor):
            self._update_on_device(found_inf)
            return
        self._pull()
        self._device = {}  # the host rule runs: the device copy is rebuilt when next needed
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)  # spent stays 0
            if self._hysteresis_tracker == 0:
                self._set_scale(max(self._scale_value * self.backoff_factor, self.min_scale))
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                # never past float32's normal range: an overflowing scale would skip every step
                self._set_scale(min(self._scale_value * self.growth_factor, MAX_SCALE))

    def _update_on_device(self, found_inf: torch.Tensor) -> None:
        """The rule of ``update()`` with tensor ops (float64 scale, int64 trackers)."""
        dev = self._to_device(found_inf.device)
        inf = found_inf.to(torch.bool)
        scale, growth, hyst = (
            dev["_scale_value"],
            dev["_growth_tracker"],
            dev["_hysteresis_tracker"],
        )
        spent = (hyst - 1).clamp(min=0)
        counted = growth + 1
        grow = ~inf & (counted >= self.growth_interval)
        backoff = inf & (spent == 0)
        new_scale = torch.where(
            backoff,
            (scale * self.backoff_factor).clamp(min=self.min_scale),
            torch.where(grow, (scale * self.growth_factor).clamp(max=MAX_SCALE), scale),
        )
        new_hyst = torch.where(inf, spent, torch.where(grow, self.hysteresis, hyst))
        new_growth = torch.where(inf | grow, 0, counted)
        scale.copy_(new_scale)
        hyst.copy_(new_hyst)
        growth.copy_(new_growth)
        self._device_updated()

    def state_dict(self) -> dict[str, Any]:
        self._pull()
        return {
            "scale": self._scale_value,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``; every value is validated first (nothing changes when one is
        refused)."""
        _state_keys(
            state_dict, "DynamicGradScaler", {"scale", "growth_tracker", "hysteresis_tracker"}
        )
        value = _scale("scale", state_dict["scale"])
        growth = _integer("growth_tracker", state_dict["growth_tracker"], 0)
        try:
            hysteresis = _integer("hysteresis_tracker", state_dict["hysteresis_tracker"], 0)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (earlier mfsdp_optim releases let the tracker go below 0 "
                "after repeated overflows, meaning 'spent'; set it to 0)"
            ) from None
        if growth >= self.growth_interval:
            raise ValueError(
                f"growth_tracker must be < growth_interval ({self.growth_interval}), got {growth}: "
                "the state was saved by a scaler with a larger growth_interval. Construct this "
                "one with the same growth_interval, or set growth_tracker to 0."
            )
        self._pull()
        self._set_scale(value)
        self._device = {}
        self._growth_tracker = growth
        self._hysteresis_tracker = hysteresis
