"""The ``torch.optim.Optimizer`` surface of the wrapper over one or several base optimizers.

``OptimizerSurface`` holds what makes the wrapper a stock-looking optimizer: torch's hook
dicts, ``param_groups``/``state``/``defaults`` (the base optimizers', the same objects),
``zero_grad``, torch's ``state_dict`` layout and the grad scaler's state. It owns the engines
(``_engine``); ``FullyShardedOptimizer`` adds the step contract on top, its ``step`` wrapped
by ``with_step_hooks`` (torch's step-hook contract without its per-call profiler range).
"""

from __future__ import annotations

import collections
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as _torch_optim

from .._infra.caches import clear_all
from .._infra.grouping import by_device_dtype
from . import _checkpointing
from ._config import OptimizerConfig
from ._engines._engine import Engine, check_disjoint
from ._grad_scaler import GradScaler

__all__ = ["OptimizerSurface", "with_step_hooks"]

_STOCK_KEYS = frozenset({"state", "param_groups"})
_SHARDED_KEYS = frozenset({"state", "param_to_group_meta"})


class OptimizerSurface(torch.optim.Optimizer):
    """The stock optimizer surface over base optimizers (see the module docstring)."""

    def _on_zero_grad(self) -> None:
        """What the step contract does when the grads are cleared (its stage)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        config: OptimizerConfig | None,
        grad_scaler: GradScaler | None,
        model_chunks: Sequence[torch.nn.Module],
    ):
        bases = _check_bases(optimizer)
        if config is not None and not isinstance(config, OptimizerConfig):
            raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise TypeError(
                "grad_scaler must be a mfsdp_optim GradScaler (ConstantGradScaler or "
                f"DynamicGradScaler), got {type(grad_scaler).__name__}"
            )
        # torch.optim.Optimizer.__init__ without the param groups (the base optimizers own them)
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # a subclass's own step(): torch's hooks around it
        self.optimizers = bases
        self.config = config if config is not None else OptimizerConfig()
        self.grad_scaler = grad_scaler
        self.model_chunks = list(model_chunks)
        if len(bases) > 1 and not self.model_chunks:
            raise ValueError(
                f"{len(bases)} base optimizers were given without model_chunks: without them a "
                "param is named by its position in its own optimizer ('param_groups.<g>.params."
                "<j>'), so the names of different optimizers collide in checkpoints and in the "
                "whole-param exchange. Pass model_chunks=[model] (the modules whose "
                "named_parameters() hold the params) to name every param by its FQN."
            )
        names = [f"optimizers[{i}]" if len(bases) > 1 else "" for i in range(len(bases))]
        self._engines = [
            Engine(o, self.model_chunks, self.config, n) for o, n in zip(bases, names, strict=True)
        ]
        check_disjoint(self._engines)

    # ------------------------------------------------------------------------------------------
    # torch.optim.Optimizer surface

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The base optimizer (with several, use ``optimizers``)."""
        if len(self.optimizers) != 1:
            raise AttributeError(
                f"this FullyShardedOptimizer wraps {len(self.optimizers)} base optimizers; use "
                "wrapper.optimizers (a list) instead of wrapper.optimizer"
            )
        return self.optimizers[0]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        if len(self.optimizers) == 1:
            return self.optimizers[0].param_groups
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self):  # type: ignore[override]
        """The base optimizers' state, keyed by the model's DTensor params (read-only view
        over several)."""
        if len(self.optimizers) == 1:
            return self.optimizers[0].state
        return collections.ChainMap(*[o.state for o in self.optimizers])

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def fast_steps(self) -> int:
        """Steps that took the fast Adam path, summed over engines (for tests, diagnostics)."""
        return sum(e.fast_steps for e in self._engines)

    @property
    def clip_folds(self) -> int:
        """Steps whose clip rode on a fused base step (for tests and diagnostics)."""
        return max(e.clip_folds for e in self._engines)

    @property
    def prepare_replays(self) -> int:
        """How many prepares replayed the recorded plan (for tests and diagnostics)."""
        return max(e.preparer.replays for e in self._engines)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of DTensor params to the base optimizer; validated like the
        constructor's groups, and on an error nothing is added."""
        engine = self._engines[0] if len(self._engines) == 1 else None
        if engine is None:
            raise TypeError("add the group to one of wrapper.optimizers: they are several")
        before = len(engine.optimizer.param_groups)
        engine.optimizer.add_param_group(param_group)
        try:
            engine.table.rebuild()
        except Exception:
            del engine.optimizer.param_groups[before:]
            raise
        self.invalidate_caches()

    def invalidate_caches(self) -> None:
        """Drop every cached view and kernel table (rebuilt at the next step). The wrapper
        notices new param groups, a new state mapping and replaced local shards itself; call
        this after replacing a value inside ``optimizer.state[p]`` by hand."""
        for e in self._engines:
            e.invalidate()
        clear_all()  # the stats layer's module-level caches (``_infra.caches``)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "FullyShardedOptimizer is not picklable; checkpoint it with state_dict() or "
            "sharded_state_dict()"
        )

    def __repr__(self) -> str:
        inner = ", ".join(repr(o) for o in self.optimizers)
        return f"FullyShardedOptimizer({inner}, config={self.config!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the params' grads (and any cast copies); back to stage READY.

        Args:
            set_to_none: Set the grads to None (True) or zero them in place (False).
        """
        grads: list[torch.Tensor] = []
        for e in self._engines:
            e.drop()
            for g in e.optimizer.param_groups:
                for p in g["params"]:
                    if set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        grads.append(p.grad)
        for tensors in by_device_dtype(grads).values():
            torch._foreach_zero_(tensors)
        self._on_zero_grad()

    # ------------------------------------------------------------------------------------------
    # torch's state dict layout and the grad scaler's state

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's stock torch state dict (what ``get_optimizer_state_dict`` reads).

        Raises:
            NotImplementedError: With ``OptimizerConfig(filter_empty_shards=True)`` (ranks that
                filtered a param hold no state for it, so the stock layout would differ between
                ranks), or with several base optimizers (use ``wrapper.optimizers`` with the
                stock helpers, or ``sharded_state_dict()``).
        """
        if self.config.filter_empty_shards:
            raise NotImplementedError(
                "state_dict() is not available with OptimizerConfig(filter_empty_shards=True): "
                "params with an empty local shard have no optimizer state on their rank, so the "
                "stock layout would differ between ranks. Use sharded_state_dict() with "
                "torch.distributed.checkpoint instead."
            )
        if len(self.optimizers) != 1:
            raise NotImplementedError(
                f"state_dict() is torch's layout of ONE optimizer; this wrapper has "
                f"{len(self.optimizers)}. Use get_optimizer_state_dict(model, wrapper.optimizers) "
                "or sharded_state_dict()."
            )
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = self.optimizer.state_dict()
        for post in self._optimizer_state_dict_post_hooks.values():
            out = post(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load either layout, told apart by its top-level keys.

        Args:
            state_dict: torch's own layout (``state``/``param_groups``, from
                [state_dict()][mfsdp_optim.optim.FullyShardedOptimizer.state_dict] or
                ``get_optimizer_state_dict``), handed to the base optimizer, or the
                fsdp_dtensor layout of ``sharded_state_dict()`` (after DCP filled it),
                validated on every rank before anything changes.

        Raises:
            ValueError: The top-level keys are neither layout's.
            StateDictMismatchError: The fsdp_dtensor state dict does not fit the optimizers (a
                ValueError, on every rank; no optimizer changed).
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        keys = set(state_dict) if isinstance(state_dict, dict) else None
        self.invalidate_caches()
        try:
            if keys == _STOCK_KEYS:
                self.optimizer.load_state_dict(state_dict)
            elif keys == _SHARDED_KEYS:
                _checkpointing.load_state_dict(self._engines, state_dict)
            else:
                got = sorted(keys) if keys is not None else type(state_dict).__name__
                raise ValueError(
                    f"load_state_dict() got a state dict with top-level keys {got}; expected "
                    f"{sorted(_STOCK_KEYS)} (torch's layout, from state_dict()) or "
                    f"{sorted(_SHARDED_KEYS)} (the fsdp_dtensor layout, from "
                    "sharded_state_dict())."
                )
        finally:
            self.invalidate_caches()
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def grad_scaler_state_dict(self) -> dict[str, Any] | None:
        """The grad scaler's state (plain numbers, equal on every rank), or None."""
        return None if self.grad_scaler is None else self.grad_scaler.state_dict()

    def load_grad_scaler_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        """Restore the grad scaler's state.

        Args:
            state_dict: What ``grad_scaler_state_dict()`` returned; None does nothing.

        Raises:
            ValueError: There is state but this optimizer has no grad scaler, or the grad
                scaler refuses a value.
        """
        if state_dict is None:
            return
        if self.grad_scaler is None:
            raise ValueError(
                "got grad scaler state but this FullyShardedOptimizer has no grad_scaler; pass "
                "one at construction"
            )
        self.grad_scaler.load_state_dict(state_dict)


def with_step_hooks(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` under torch's step-hook contract, as ``Optimizer.profile_hook_step`` wraps every
    optimizer's ``step``: the global and the optimizer's own pre hooks (a pre hook may return
    new ``(args, kwargs)``; ``args`` starts with the optimizer), the step,
    ``_optimizer_step_code()`` (the profiler's probe), the own and global post hooks; and,
    while a profiler runs, the same ``record_function`` range (``Optimizer.step#<class>.step``).
    torch's wrapper enters that range at every call, profiling or not: about half of its
    ~10 us, as much as the rest of a captured step's replay over 10 params.

    Marked ``hooked`` so ``_patch_step_function`` keeps it. A subclass that defines its own
    ``step`` gets torch's wrapper around that one, and its ``super().step()`` runs here without
    the hooks (they fire once)."""

    @functools.wraps(step)
    def hooked_step(*args: Any, **kwargs: Any) -> Any:
        opt = args[0]
        if type(opt).step is not hooked_step:  # under a subclass's step: torch fired the hooks
            return step(*args, **kwargs)
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(
                f"Optimizer.step#{type(opt).__name__}.step"
            ):
                return _run_hooked(step, opt, args, kwargs)
        return _run_hooked(step, opt, args, kwargs)

    hooked_step.hooked = True  # type: ignore[attr-defined]
    return hooked_step


def _run_hooked(step: Callable[..., Any], opt: Any, args: tuple, kwargs: dict) -> Any:
    """The pre hooks, ``step``, the profiler's probe and the post hooks (``with_step_hooks``)."""
    global_pre = _torch_optim._global_optimizer_pre_hooks
    own_pre = opt._optimizer_step_pre_hooks
    if global_pre or own_pre:
        for pre_hook in chain(global_pre.values(), own_pre.values()):
            result = pre_hook(opt, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"the optimizer step pre hook {pre_hook!r} returned {result!r}; a step "
                        "pre hook returns None or a tuple (new_args, new_kwargs)"
                    )
                args, kwargs = result
    out = step(*args, **kwargs)
    opt._optimizer_step_code()
    own_post = opt._optimizer_step_post_hooks
    global_post = _torch_optim._global_optimizer_post_hooks
    if own_post or global_post:
        for post_hook in chain(own_post.values(), global_post.values()):
            post_hook(opt, args, kwargs)
    return out


def _check_bases(optimizer: Any) -> list[torch.optim.Optimizer]:
    bases = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not bases:
        raise ValueError("optimizer is an empty sequence; pass at least one base optimizer")
    for i, o in enumerate(bases):
        where = "optimizer" if len(bases) == 1 else f"optimizer[{i}]"
        if isinstance(o, OptimizerSurface):
            raise TypeError(f"{where} is already a FullyShardedOptimizer; wrap the base one")
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"{where} must be a torch.optim.Optimizer, got {type(o).__name__}")
    return bases
