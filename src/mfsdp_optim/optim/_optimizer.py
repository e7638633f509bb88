"""``FullyShardedOptimizer``: any ``torch.optim`` optimizer (or several) over DTensor params.

The step contract: prepare (``_step_data``: unscale, cast, ONE grad_stats collective over every
base optimizer's grads, each one's norm in the same row) -> found_inf and a grad scaler: skip on
every rank, update the scaler -> clip to ``config.clip_grad`` under ``config.clip_scope`` -> each
engine's base step (``_engines``) -> restore cast grads.
This class is the whole wrapper: the stock optimizer surface (torch's hook dicts,
``param_groups``/``state``/``defaults``, the base optimizers' own objects, ``zero_grad``,
torch's ``state_dict`` layout, the grad scaler's state), the stages and the step, and the
checkpoint adapter (``_checkpointing``); its ``step`` runs under torch's step-hook contract
(``_step_hooks``); each base optimizer's caches live in its ``Engine``.
"""

from __future__ import annotations

import collections
import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._infra.caches import clear_all
from .._infra.grouping import by_device_dtype
from ..stats.seam import check_max_norm, clip_divisor, scale_by_clip_coef_
from . import _checkpointing
from ._agreed import AgreedSlots
from ._config import OptimizerConfig
from ._engines._engine import Engine, check_disjoint
from ._grad_scaler import GradScaler
from ._step_data import Prepared, StepResult, clip_norms, prepare, stats_of
from ._step_hooks import with_step_hooks

__all__ = ["FullyShardedOptimizer", "OptimizerConfig", "Stage"]

_STOCK_KEYS = frozenset({"state", "param_groups"})
_SHARDED_KEYS = frozenset({"state", "param_to_group_meta"})


class Stage(enum.Enum):
    """Where one iteration stands (like ``torch.amp.GradScaler``'s per-optimizer stage)."""

    READY = "READY"  # grads may be produced; prepare_grads() or step() next
    PREPARED = "PREPARED"  # grads unscaled and cast; step_with_ready_grads() next
    STEPPED = "STEPPED"  # the grads were used; zero_grad() or the next backward next


class FullyShardedOptimizer(torch.optim.Optimizer):
    """Any ``torch.optim.Optimizer`` over DTensor params (FSDP2, HSDP, TP+FSDP, expert meshes).

    Args:
        optimizer: The base optimizer, built over the model's DTensor params, or a sequence of
            base optimizers over disjoint params (e.g. ``[Muon(2-D weights), AdamW(rest)]``):
            one grad-stats collective, one clip and one skip decision cover all of them. Each
            stays a stock torch optimizer: dropping the wrapper continues training with plain
            torch.
        config: Clipping, norm type, zero counting, the grad-stats group and extras
            ([OptimizerConfig][mfsdp_optim.optim.OptimizerConfig]).
        grad_scaler: A [ConstantGradScaler][mfsdp_optim.optim.ConstantGradScaler] or
            [DynamicGradScaler][mfsdp_optim.optim.DynamicGradScaler]; steps with NaN/inf grads on
            any rank are then skipped on every rank.
        init_state_fn: Creates a base optimizer's state for checkpoint loading
            (``sharded_state_dict(is_loading=True)``), instead of a scratch step.
        model_chunks: The modules whose ``named_parameters()`` name the params (FQNs).

    ``param_groups`` is the base optimizers' groups (the same dicts), ``state`` their state;
    lr schedulers accept the wrapper; torch's global step hooks and the wrapper's own hooks fire
    once per ``step()``, the base optimizers' hooks whenever their ``step()`` runs.

    Attributes:
        last_update_successful: What the last ``step()`` returned first (None before one): for
            trainers that discard ``step()``'s return value (the documentation's Trainers
            page). A 0-d device bool under ``OptimizerConfig(host_sync=False)``, like the
            return value.
        last_grad_norm: The last ``step()``'s pre-clip global grad norm (float, or a 0-d
            float32 device tensor under ``host_sync=False``).
        last_num_zeros: The last ``step()``'s zero count (None unless
            ``config.log_num_zeros_in_grad``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        config: OptimizerConfig | None = None,
        grad_scaler: GradScaler | None = None,
        init_state_fn: Callable[[torch.optim.Optimizer], None] | None = None,
        model_chunks: Sequence[torch.nn.Module] = (),
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
        self._init_state_fn = init_state_fn
        self._stage = Stage.READY
        # the last step(), for trainers that discard its return value (see step())
        self.last_update_successful: Any = None
        self.last_grad_norm: Any = None
        self.last_num_zeros: Any = None
        self._grad_norms: tuple[Any, ...] = ()
        # every step's hyperparameter digests, in the stats row (ranks agree on the values)
        self._agreement = AgreedSlots(self.optimizers, self.config.rank_dependent_keys)
        scope = self.config.clip_scope
        if isinstance(scope, tuple) and scope and scope[-1] >= len(self.optimizers):
            raise ValueError(
                f"OptimizerConfig.clip_scope={scope!r} names base optimizer {scope[-1]}, but the "
                f"wrapper has {len(self.optimizers)} (indices 0 to {len(self.optimizers) - 1})"
            )
        self._captured: Any = None  # OptimizerConfig(cuda_graph=True): _captured._step.CapturedStep
        if self.config.cuda_graph:
            self._captured = self._captured_step()

    def _captured_step(self, runner: Any = None, step_class: Any = None) -> Any:
        """A ``CapturedStep`` (or ``step_class``, a subclass) over this wrapper's engines, agreed
        slots and stage (``runner``: tests and benchmarks, instead of a CUDA graph)."""
        from ._captured._step import CapturedStep

        return (step_class or CapturedStep)(
            self,
            self._engines,
            self._agreement,
            stage_of=self._stage_now,
            set_stage=self._set_stage,
            runner=runner,
        )

    def _stage_now(self) -> Stage:
        return self._stage

    def _set_stage(self, stage: Stage) -> None:
        self._stage = stage

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
        self._stage = Stage.READY

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

    @property
    def grad_norms(self) -> tuple[Any, ...]:
        """Each base optimizer's pre-clip grad norm (``config.norm_type``) from the last
        ``step()``, in ``optimizers`` order: floats, or 0-d device tensors under
        ``OptimizerConfig(host_sync=False)``; from the step's one collective; ``()`` before the
        first step. Non-finite where that step's grads were."""
        return self._grad_norms

    # ------------------------------------------------------------------------------------------
    # the step

    def _prepare(self, defer: bool = False) -> Prepared:
        if self._stage is Stage.PREPARED:
            raise RuntimeError(
                "prepare_grads() was already called for this step (the grads are already "
                "unscaled); call step_with_ready_grads() or zero_grad() before preparing again."
            )
        scaler, cfg = self.grad_scaler, self.config
        unscale = scaler is not None and scaler.needs_unscale()
        prep = prepare(
            self._engines,
            agreement=self._agreement,
            inv_scale_on=scaler.inv_scale_on if unscale else None,  # type: ignore[union-attr]
            norm_type=cfg.norm_type,
            count_zeros=cfg.log_num_zeros_in_grad,
            group=cfg.grad_stats_group,
            host_sync=cfg.host_sync,
            defer=defer,
        )
        self._stage = Stage.PREPARED
        return prep

    def _current_stats(self, count_zeros: bool):
        cfg = self.config
        prepared = self._stage is Stage.PREPARED
        grads = [e.current_grads(prepared) for e in self._engines]
        return stats_of(
            grads,
            norm_type=cfg.norm_type,
            count_zeros=count_zeros,
            group=cfg.grad_stats_group,
            host_sync=cfg.host_sync,
            in_group=self._engines[0].table.in_stats_group,
        ).stats

    def _check_ready_for_step(self, what: str) -> None:
        if self._stage is not Stage.PREPARED:
            hint = (
                "the grads were already used by a step; run backward (and zero_grad) for the "
                "next one"
                if self._stage is Stage.STEPPED
                else "call prepare_grads() first"
            )
            raise RuntimeError(f"{what} called in stage {self._stage.value}: {hint}.")

    def prepare_grads(self) -> bool:
        """Unscale and cast the grads and agree on non-finite values.

        One collective, one host sync (for the returned bool).

        Returns:
            found_inf: whether any grad on any rank holds a NaN or an inf, the same on every
                rank of the grad-stats group.
        """
        prep = self._prepare()
        return bool(prep.stats.found_inf if prep.host is None else prep.host[0])

    def step_with_ready_grads(self) -> bool:
        """The base optimizer step on prepared grads (no clipping); restores grad dtypes.

        Call after [prepare_grads()][mfsdp_optim.optim.FullyShardedOptimizer.prepare_grads].

        Returns:
            True (the update ran).
        """
        self._check_ready_for_step("step_with_ready_grads()")
        self._run_engines(None, None)
        return True

    def _run_engines(
        self, clip_norms: Sequence[torch.Tensor | None] | None, gate: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Every engine's base step (clipped to ``config.clip_grad`` by its entry of
        ``clip_norms``; None: unclipped), then stage STEPPED even if one raises; ``gate``: skip
        on the device where it is 1.

        Under ``host_sync=False`` a whole-param update that keeps its verdict on the device
        (Muon) returns it instead of raising: every later engine that skips on the device is
        gated on it too, and a failure of this rank's own is raised once every engine ran, as
        its peers, which cannot know of it, run them. Returns the verdicts (a 0-d bool: some
        update was refused on every rank), or None where there were none."""
        clip = self.config.clip_grad
        pending = list(self._engines)
        norms = list(clip_norms) if clip_norms is not None else [None] * len(pending)
        refused: torch.Tensor | None = None
        own: BaseException | None = None
        try:
            while pending:
                clip_norm = norms[len(norms) - len(pending)]
                e = pending.pop(0)
                divisor = None
                if clip_norm is not None:
                    if e.route.fold_clip:
                        divisor = clip_divisor(clip, clip_norm)
                        e.clip_folds += 1
                    else:
                        scale_by_clip_coef_(e.preparer.work_locals, clip, clip_norm)
                engine_gate = gate
                if refused is not None and e.skips_on_device():
                    flag = refused.to(torch.float32)
                    engine_gate = flag if gate is None else torch.maximum(gate, flag)
                e.step(divisor, engine_gate)
                bad, error = e.take_verdict()
                if bad is not None:
                    refused = bad if refused is None else refused | bad
                own = own or error
        finally:
            for e in pending:  # not stepped (an earlier engine raised): restore their grads
                e.skip()
            self._stage = Stage.STEPPED
        if own is not None:
            raise own
        return refused

    def get_grad_norm(self) -> float:
        """The global ``config.norm_type`` norm of the current grads (one collective)."""
        return float(self._current_stats(False).total_norm)

    def count_zeros(self) -> int:
        """Zero elements of the current global grads, each counted once (one collective)."""
        stats = self._current_stats(True)
        assert stats.num_zeros is not None
        return int(stats.num_zeros)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the current grads to ``max_norm`` globally.

        Args:
            max_norm: The global norm to clip to.

        Returns:
            The global norm before clipping.
        """
        max_norm = check_max_norm(max_norm)
        norm = self._current_stats(False).total_norm
        prepared = self._stage is Stage.PREPARED
        grads = [g for e in self._engines for g in e.current_grads(prepared)]
        scale_by_clip_coef_(by_device_dtype(grads), max_norm, norm)
        return float(norm)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale the loss by the loss scale.

        Args:
            loss: The loss.

        Returns:
            ``loss * loss_scale`` (the loss itself without a grad scaler).
        """
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale_on(loss.device).to(loss.dtype)

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale as a 0-d float32 tensor (1.0 without a grad scaler)."""
        if self.grad_scaler is None:
            return torch.ones((), dtype=torch.float32)
        return self.grad_scaler.scale

    @with_step_hooks
    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One training step: prepare the grads, clip, and run the base optimizers' steps.

        Step hooks fire around it, torch's global ones once. With
        ``OptimizerConfig(host_sync=False)`` the three values are 0-d device tensors (bool,
        float32, int64 or None) and nothing waits for the device.

        Args:
            closure: If given, called first with grad enabled (it should run backward).

        Returns:
            update_successful (bool): Whether the base optimizers' updates ran.
            grad_norm (float): The global norm before clipping (non-finite when the step was
                skipped).
            num_zeros_in_grad (int | None): None unless ``config.log_num_zeros_in_grad``.

        Raises:
            HyperparameterMismatchError: On every rank of the grad-stats group, when ranks'
                param groups hold different values (checked in the step's one collective;
                nothing changed). With ``host_sync=False`` nothing is read on the host
                instead: the step returns a NaN norm and is skipped where it can be skipped
                (see "Ranks agree on hyperparameters" in the documentation's Concepts page).
            RankFailedError: On the ranks whose own input was fine, when another rank's was
                refused (that rank raises its own error).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._stage is Stage.PREPARED:
            raise RuntimeError(
                "step() called after prepare_grads(): the grads are already prepared; finish "
                "with step_with_ready_grads() (or zero_grad() to drop them)."
            )
        if self._captured is not None and self.config.cuda_graph:
            out = self._captured.run(self._no_grad_body)  # a replay records no autograd op
        else:
            out = self._no_grad_body()
        self.last_update_successful, self.last_grad_norm, self.last_num_zeros = out
        return out

    @torch.no_grad()
    def _no_grad_body(self) -> tuple[Any, Any, Any]:
        """``_step_body`` with grad mode off (the eager step, and what is captured)."""
        return self._step_body()

    def _step_body(self) -> tuple[Any, Any, Any]:
        """``step()`` after its closure and stage checks: what a captured step captures."""
        scaler, on_host = self.grad_scaler, self.config.host_sync
        # without a scaler the host waits only after the update is enqueued (see _step)
        prep = self._prepare(defer=on_host and scaler is None)
        stats, result = prep.stats, StepResult(prep.seg, prep.host)
        device_skip = None
        on_device = not on_host and all(e.skips_on_device() for e in self._engines)
        if scaler is None and on_device and prep.seg.bad is not None:
            # the device verdict (a rank failed, ranks' hyperparameters or grad presence differ)
            # gates the update; non-finite grads do not, as without a scaler in stock torch
            device_skip = prep.seg.bad
        if scaler is not None:
            if on_device:
                device_skip = stats.found_inf
                scaler.update(device_skip)  # on the device: no host read
            else:
                found_inf = result.found_inf()  # the skip decision: one host read
                scaler.update(found_inf)
                if found_inf:
                    for e in self._engines:
                        e.skip()
                    self._stage = Stage.STEPPED
                    self._grad_norms = result.norms(on_host)
                    return result.values(False, on_host)
        gate = device_skip if prep.deferred is None else prep.deferred[0]
        cfg = self.config
        clipped = clip_norms(prep.seg, cfg.clip_scope, cfg.norm_type) if cfg.clip_grad > 0 else None
        refused = self._run_engines(clipped, None if gate is None else gate.to(torch.float32))
        if prep.deferred is not None:
            # the collective's verdict (raises on every rank if one failed) and the values: it
            # waits for the stats' host copy, enqueued before the update, not for the update
            result.host = prep.deferred[1]()
        self._grad_norms = result.norms(on_host)
        if device_skip is not None:  # decided on the device
            out = (~device_skip, stats.total_norm, stats.num_zeros)
        else:
            out = result.values(True, on_host)
        if refused is not None:  # a whole-param update refused on the device, on every rank
            out = (out[0] & ~refused, torch.where(refused, torch.nan, out[1]), out[2])
        return out

    # ------------------------------------------------------------------------------------------
    # checkpoints and grad scaler state

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        metadata: dict | None = None,
    ) -> dict[str, Any]:
        """The fsdp_dtensor optimizer state dict over every param (see
        [mfsdp_optim.checkpoint][]).

        The grad scaler's state travels separately:
        [grad_scaler_state_dict()][mfsdp_optim.optim.FullyShardedOptimizer.grad_scaler_state_dict].

        Args:
            model_sharded_state_dict: Accepted for Megatron-Core parity and ignored.
            is_loading: Build a load target: params without state first get the state their
                first step would create (or ``init_state_fn``'s).
            metadata: Accepted for Megatron-Core parity and ignored.

        Returns:
            This rank's fsdp_dtensor state dict, for ``torch.distributed.checkpoint``.
        """
        return _checkpointing.build_state_dict(
            self._engines, is_loading=is_loading, init_state_fn=self._init_state_fn
        )


# -- for the repository's tools, through ``optim.seam`` (not public API) ----------------------


def engines_of(wrapper: FullyShardedOptimizer) -> list[Engine]:
    """The wrapper's engines, one per base optimizer, in ``optimizers`` order (its own list)."""
    return wrapper._engines


def captured_step_of(wrapper: FullyShardedOptimizer) -> Any:
    """The wrapper's captured step (``OptimizerConfig(cuda_graph=True)``), or None."""
    return wrapper._captured


def use_captured_step(
    wrapper: FullyShardedOptimizer, step_class: Any = None, runner: Any = None
) -> Any:
    """Give the wrapper a new captured step, ``step_class`` (``CapturedStep`` or a subclass)
    over its engines, agreed slots and stage, and return it; ``runner``: a stand-in for the
    CUDA graph (with ``warm``, ``capture``, ``replay``, ``reset``), for CPU params. The wrapper
    steps through it where ``config.cuda_graph`` is set."""
    wrapper._captured = wrapper._captured_step(runner, step_class)
    return wrapper._captured


def _check_bases(optimizer: Any) -> list[torch.optim.Optimizer]:
    bases = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not bases:
        raise ValueError("optimizer is an empty sequence; pass at least one base optimizer")
    for i, o in enumerate(bases):
        where = "optimizer" if len(bases) == 1 else f"optimizer[{i}]"
        if isinstance(o, FullyShardedOptimizer):
            raise TypeError(f"{where} is already a FullyShardedOptimizer; wrap the base one")
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"{where} must be a torch.optim.Optimizer, got {type(o).__name__}")
    return bases
