"""``FullyShardedOptimizer``: any ``torch.optim`` optimizer (or several) over DTensor params.

The step contract: prepare (``_prepared``: unscale, cast, ONE grad_stats collective over every
base optimizer's grads, each one's norm in the same row) -> found_inf and a grad scaler: skip on
every rank, update the scaler -> clip to ``config.clip_grad`` under ``config.clip_scope`` -> each
engine's base step (``_engine``) -> restore cast grads.
This class keeps the stages, the config and the checkpoint adapter (``_checkpointing``); the
stock optimizer surface is ``_surface.OptimizerSurface``; each base optimizer's caches live in
its ``Engine``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._infra.grouping import by_device_dtype
from ..stats import check_max_norm, clip_divisor, scale_by_clip_coef_
from . import _checkpointing
from ._agreed import AgreedSlots
from ._config import OptimizerConfig
from ._grad_scaler import GradScaler
from ._prepared import Prepared, StepResult, clip_norms, prepare, stats_of
from ._surface import OptimizerSurface, with_step_hooks

__all__ = ["FullyShardedOptimizer", "OptimizerConfig", "Stage"]


class Stage(enum.Enum):
    """Where one iteration stands (like ``torch.amp.GradScaler``'s per-optimizer stage)."""

    READY = "READY"  # grads may be produced; prepare_grads() or step() next
    PREPARED = "PREPARED"  # grads unscaled and cast; step_with_ready_grads() next
    STEPPED = "STEPPED"  # the grads were used; zero_grad() or the next backward next


class FullyShardedOptimizer(OptimizerSurface):
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
        super().__init__(optimizer, config, grad_scaler, model_chunks)
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
            from ._captured._step import CapturedStep

            self._captured = CapturedStep(self)

    @property
    def grad_norms(self) -> tuple[Any, ...]:
        """Each base optimizer's pre-clip grad norm (``config.norm_type``) from the last
        ``step()``, in ``optimizers`` order: floats, or 0-d device tensors under
        ``OptimizerConfig(host_sync=False)``; from the step's one collective; ``()`` before the
        first step. Non-finite where that step's grads were."""
        return self._grad_norms

    # ------------------------------------------------------------------------------------------
    # the step

    def _on_zero_grad(self) -> None:
        self._stage = Stage.READY

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
