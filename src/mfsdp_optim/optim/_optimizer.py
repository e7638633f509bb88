"""The wrapper layer: ``FullyShardedOptimizer``, any ``torch.optim`` optimizer over DTensor params.

The step contract (Megatron-Core's mixed-precision optimizer, on DTensors)::

    step() = prepare_grads()     unscale, cast grads whose dtype differs from the param's, ONE
                                 grad_stats collective (norm, zeros, found_inf)
             -> found_inf and a grad scaler: skip on every rank, update the scaler
             -> clip to config.clip_grad (folded into a fused base step where it can be)
             -> the base step on local shards -> restore cast grads

The wrapper never changes the user's optimizer: outside ``step()`` its param groups hold the
model's DTensors and its state is what stock torch keeps for them. Speed lives inside ``step()``
(``_views``: the base step on local shards; ``_fast_step``: torch's Adam kernels on cached
lists; ``_prepare``: a replayed prepare plan) and in the wrapper's private fields. Where each
concern lives: options ``_config``, param table ``_slots``, grads ``_prepare``, which step runs
``_dispatch``, hyperparameter checks ``_hyper``, the reduction ``_reduce``, clipping ``_clip``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._infra.params import ParamRecord
from ..stats._buckets import Buckets, bucket_local_shards
from ..stats._clip import check_max_norm, clip_divisor, scale_by_clip_coef_
from ..stats._reduce import (
    GradStats,
    packed_values,
    reduce_buckets,
    reduce_buckets_deferred,
    reduce_buckets_read,
)
from ._config import OptimizerConfig
from ._dispatch import Route, base_step, detect_precision_aware, route_of
from ._fast_step import FastAdamStep
from ._grad_scaler import GradScaler
from ._hyper import check_param_groups
from ._prepare import Preparer
from ._slots import SlotTable
from ._triton_adam import TritonAdam

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
        optimizer: The base optimizer, built over the model's DTensor params. It stays a stock
            torch optimizer: its ``param_groups`` and ``state`` are exactly what stock torch
            keeps, so dropping the wrapper continues training with plain torch.
        config: Clipping, norm type, zero counting, the grad-stats group and extras
            ([OptimizerConfig][mfsdp_optim.optim.OptimizerConfig]).
        grad_scaler: A [ConstantGradScaler][mfsdp_optim.optim.ConstantGradScaler] or
            [DynamicGradScaler][mfsdp_optim.optim.DynamicGradScaler]; steps with NaN/inf
            grads on any rank are then skipped on every rank.
        init_state_fn: Creates the base optimizer's state for checkpoint loading
            (``sharded_state_dict(is_loading=True)``), instead of a scratch step.
        model_chunks: The modules whose ``named_parameters()`` name the params (FQNs).

    ``param_groups``, ``state`` and ``defaults`` are the base optimizer's; lr schedulers accept
    the wrapper; torch's global step hooks and the wrapper's own hooks fire once per
    ``step()``, the base optimizer's hooks whenever its ``step()`` runs.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig | None = None,
        grad_scaler: GradScaler | None = None,
        init_state_fn: Callable[[torch.optim.Optimizer], None] | None = None,
        model_chunks: Sequence[torch.nn.Module] = (),
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, FullyShardedOptimizer):
            raise TypeError("optimizer is already a FullyShardedOptimizer; wrap the base one")
        if config is not None and not isinstance(config, OptimizerConfig):
            raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise TypeError(
                "grad_scaler must be a mfsdp_optim GradScaler (ConstantGradScaler or "
                f"DynamicGradScaler), got {type(grad_scaler).__name__}"
            )
        # torch.optim.Optimizer.__init__ without the param groups (the base optimizer owns them)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # torch's hook machinery around step()

        self.optimizer = optimizer
        self.config = config if config is not None else OptimizerConfig()
        self.grad_scaler = grad_scaler
        self._init_state_fn = init_state_fn
        self.model_chunks = list(model_chunks)
        aware, self._decoupled_grad = detect_precision_aware(optimizer)
        if self.config.precision_aware is not None:
            aware = self.config.precision_aware
        self._precision_aware = bool(aware)
        self._table = SlotTable(
            optimizer,
            self.model_chunks,
            filter_empty=self.config.filter_empty_shards,
            stats_group=self.config.grad_stats_group,
        )
        self._stage = Stage.READY
        self._stats: GradStats | None = None
        self._preparer = Preparer()
        self._fast = FastAdamStep()
        self._fast_token: object | None = None  # the fast cache this step's grads were put in
        self._route = Route(False, False)
        # (bad, verdict) of a deferred stats verdict (see _prepare), for the step in progress
        self._deferred: tuple[torch.Tensor, Callable[[], list[float]]] | None = None
        # the stats' host values read with the collective's verdict (host_sync=True)
        self._stats_host: list[float] | None = None
        self._triton = TritonAdam() if self.config.triton_adam_step else None
        self.last_update_successful: bool | None = None
        self.fast_steps = 0  # steps that took the fast path (for tests and diagnostics)
        self.clip_folds = 0  # steps whose clip rode on the fused base step (likewise)

    # ------------------------------------------------------------------------------------------
    # torch.optim.Optimizer surface

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self):  # type: ignore[override]
        """The base optimizer's state, keyed by the model's DTensor params."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def prepare_replays(self) -> int:
        """How many prepares replayed the recorded plan (for tests and diagnostics)."""
        return self._preparer.replays

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of DTensor params to the base optimizer; validated like the
        constructor's groups, and on an error nothing is added."""
        before = len(self.optimizer.param_groups)
        self.optimizer.add_param_group(param_group)
        try:
            self._table.rebuild()
        except Exception:
            del self.optimizer.param_groups[before:]
            raise
        self.invalidate_caches()

    def invalidate_caches(self) -> None:
        """Drop the wrapper's cached lists (rebuilt at the next step). The wrapper notices new
        param groups, a new state mapping and replaced local shards itself; call this after
        replacing a value inside ``optimizer.state[p]`` by hand."""
        self._fast.invalidate()
        self._preparer.plan = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "FullyShardedOptimizer is not picklable; checkpoint it with state_dict() or "
            "sharded_state_dict()"
        )

    def __repr__(self) -> str:
        return f"FullyShardedOptimizer({self.optimizer!r}, config={self.config!r})"

    # ------------------------------------------------------------------------------------------
    # grads and statistics

    def _current_grads(self) -> list[DTensor]:
        """The grads statistics and clipping act on now (the cast copies while PREPARED)."""
        slots = self._table.slots
        if self._stage is Stage.PREPARED:
            return [s.work_grad for s in slots if s.work_grad is not None]
        return [s.param.grad for s in slots if s.param.grad is not None]  # type: ignore[misc]

    def _reduce(self, buckets: Buckets | Exception, count_zeros: bool) -> GradStats:
        if not self._table.in_stats_group:  # a paramless rank outside the group
            if isinstance(buckets, Exception):
                raise buckets
            zero = torch.zeros((), dtype=torch.float32)
            return GradStats(
                zero,
                torch.zeros((), dtype=torch.int64) if count_zeros else None,
                torch.zeros((), dtype=torch.bool),
            )
        kwargs: dict[str, Any] = dict(
            norm_type=self.config.norm_type,
            count_zeros=count_zeros,
            group=self.config.grad_stats_group,
        )
        if not self.config.host_sync:
            return reduce_buckets(buckets, host_sync=False, **kwargs)
        stats, self._stats_host = reduce_buckets_read(buckets, **kwargs)
        return stats

    def _stats_of_current(self, count_zeros: bool) -> GradStats:
        buckets: Buckets | Exception
        try:
            buckets = bucket_local_shards(self._current_grads(), self.config.grad_stats_group)
        except Exception as exc:  # joins the collective, so no rank waits, then raises
            buckets = exc
        return self._reduce(buckets, count_zeros)

    def _prepare(self, defer: bool = False) -> GradStats:
        """Validate, unscale, cast, bucket, and take the stats; no host synchronisation.

        ``defer``: where the fused fast step runs, postpone the collective's host-side verdict
        (``_reduce.reduce_buckets_deferred``) until the update is enqueued, the update gated on
        the device by "some rank failed" (``self._deferred``); see ``_step_impl``."""
        if self._stage is Stage.PREPARED:
            raise RuntimeError(
                "prepare_grads() was already called for this step (the grads are already "
                "unscaled); call step_with_ready_grads() or zero_grad() before preparing again."
            )
        scaler = self.grad_scaler
        try:
            if self._table.sync():
                self.invalidate_caches()
            check_param_groups(self.optimizer.param_groups)
            self._route = route_of(self.optimizer, precision_aware=self._precision_aware)
            token = None
            if self._route.fast:
                # a plan recorded over this fast cache vouches for the params' local tensors
                plan = self._preparer.plan
                trust = (
                    plan is not None
                    and self._fast.token is not None
                    and (plan.fast_token is self._fast.token)
                )
                token = self._fast.begin(self.optimizer, self._table, trust_locals=trust)
            self._fast_token = token
            buckets: Buckets | Exception = self._preparer.collect(
                self._table.slots,
                cast_grads=not self._precision_aware,
                group=self.config.grad_stats_group,
                fast_token=token,
            )
            if (
                token is not None
                and trust
                and not self._preparer.replayed
                and (not self._fast.locals_ok())
            ):
                self._fast.invalidate()  # a local tensor was replaced: generic now, rebuilt next
                self._fast_token = None
            if scaler is not None and scaler.needs_unscale():
                self._preparer.unscale(scaler.inv_scale_on, buckets)  # type: ignore[arg-type]
        except Exception as exc:  # joins the collective, so no rank waits, then raises
            buckets = exc
        self._deferred = None
        self._stats_host = None
        try:
            if (
                defer
                and not isinstance(buckets, BaseException)
                and self._table.in_stats_group
                and self._skips_on_device()
            ):
                stats, bad, verdict = reduce_buckets_deferred(
                    buckets,
                    norm_type=self.config.norm_type,
                    count_zeros=self.config.log_num_zeros_in_grad,
                    group=self.config.grad_stats_group,
                )
                self._deferred = (bad, verdict)
            else:
                stats = self._reduce(buckets, self.config.log_num_zeros_in_grad)
        except Exception:
            self._drop_work()
            raise
        self._stats = stats
        self._stage = Stage.PREPARED
        return stats

    def _drop_work(self) -> None:
        self._preparer.drop(self._table.slots)
        self._fast.clear()
        self._fast_token = None

    def _run_base_step(
        self, grad_divisor: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
    ) -> None:
        """The base step on the prepared grads, then restore cast grads. ``grad_divisor``: a
        folded clip (``route.fold_clip``), handed to the fused step as its ``grad_scale``;
        ``found_inf``: skip on the device (only where ``_skips_on_device()``)."""
        opt, table = self.optimizer, self._table
        try:
            if self._fast_token is not None and self._fast.ready(opt, table):
                keys = self._preparer.work_locals
                devices = {k[0] for k in keys}
                dtypes = {k[1] for k in keys}  # the work grads' dtypes (bucket keys carry them)
                one = next(iter(dtypes)) if len(dtypes) == 1 else None
                self._fast.step(opt, devices, grad_divisor, self._triton, found_inf, one)
                self.fast_steps += 1
            else:
                assert found_inf is None, "a device-side skip needs the fast step"
                self._fast.clear()
                base_step(opt, table.slots, decoupled=self._decoupled_grad, grad_scale=grad_divisor)
        finally:
            self._fast.clear()
            self._fast_token = None
            self._preparer.restore(table.slots)

    def _check_ready_for_step(self, what: str) -> None:
        if self._stage is not Stage.PREPARED:
            hint = (
                "the grads were already used by a step; run backward (and zero_grad) for the "
                "next one"
                if self._stage is Stage.STEPPED
                else "call prepare_grads() first"
            )
            raise RuntimeError(f"{what} called in stage {self._stage.value}: {hint}.")

    # ------------------------------------------------------------------------------------------
    # public step API

    def prepare_grads(self) -> bool:
        """Unscale and cast the grads and agree on non-finite values.

        One collective, one host sync (for the returned bool).

        Returns:
            found_inf: whether any grad on any rank holds a NaN or an inf, the same on every
                rank of the grad-stats group.
        """
        stats = self._prepare()
        host = self._stats_host  # read with the collective's verdict, where it was
        return bool(stats.found_inf if host is None else host[0])

    def step_with_ready_grads(self) -> bool:
        """The base optimizer step on prepared grads (no clipping); restores grad dtypes.

        Call after [prepare_grads()][prepare_grads].

        Returns:
            True (the update ran).
        """
        self._check_ready_for_step("step_with_ready_grads()")
        try:
            self._run_base_step()
        finally:
            self._stage = Stage.STEPPED
        return True

    def get_grad_norm(self) -> float:
        """The global ``config.norm_type`` norm of the current grads (one collective)."""
        return float(self._stats_of_current(False).total_norm)

    def count_zeros(self) -> int:
        """Zero elements of the current global grads, each counted once (one collective)."""
        stats = self._stats_of_current(True)
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
        norm = self._stats_of_current(False).total_norm
        by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in self._current_grads():
            local = g._local_tensor
            by_key[(local.device, local.dtype)].append(local)
        scale_by_clip_coef_(by_key, max_norm, norm)
        return float(norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the params' grads (and any cast copies); back to stage READY.

        Args:
            set_to_none: Set the grads to None (True) or zero them in place (False).
        """
        self._drop_work()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if set_to_none:
            for p in params:
                p.grad = None
        else:
            by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in params:
                g = p.grad
                if g is not None:
                    local = g._local_tensor if isinstance(g, DTensor) else g
                    by_key[(local.device, local.dtype)].append(local)
            for tensors in by_key.values():
                torch._foreach_zero_(tensors)
        self._stage = Stage.READY
        self._stats = None

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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One training step: prepare the grads, clip, and run the base optimizer's step.

        Step hooks fire around it, torch's global ones once. Returns the tuple
        ``(update_successful, grad_norm, num_zeros_in_grad)``. With
        ``OptimizerConfig(host_sync=False)`` the three are 0-d device tensors (bool, float32,
        int64 or None) and nothing waits for the device.

        Args:
            closure: If given, called first with grad enabled (it should run backward).

        Returns:
            update_successful (bool): Whether the base optimizer's update ran.
            grad_norm (float): The global norm before clipping (non-finite when the step was
                skipped).
            num_zeros_in_grad (int | None): None unless ``config.log_num_zeros_in_grad``.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        return self._step_impl()

    def _step_impl(self) -> tuple[Any, Any, Any]:
        if self._stage is Stage.PREPARED:
            raise RuntimeError(
                "step() called after prepare_grads(): the grads are already prepared; finish "
                "with step_with_ready_grads() (or zero_grad() to drop them)."
            )
        scaler = self.grad_scaler
        on_host = self.config.host_sync
        # without a scaler the host waits only after the update is enqueued (see _prepare)
        stats = self._prepare(defer=on_host and scaler is None)
        deferred = self._deferred
        result = _StepResult(stats, self._stats_host)
        device_skip = None
        if scaler is not None:
            if not on_host and self._skips_on_device():
                device_skip = stats.found_inf
                scaler.update(device_skip)  # on the device: no host read
            else:
                found_inf = result.found_inf()  # the skip decision: one host read
                scaler.update(found_inf)
                if found_inf:
                    self._fast.clear()
                    self._fast_token = None
                    self._preparer.restore(self._table.slots)
                    self._stage = Stage.STEPPED
                    self.last_update_successful = False
                    return result.values(False, on_host)
        divisor = None
        clip = self.config.clip_grad
        if clip > 0:
            if self._route.fold_clip:
                divisor = clip_divisor(clip, stats.total_norm)
                self.clip_folds += 1
            else:
                scale_by_clip_coef_(self._preparer.work_locals, clip, stats.total_norm)
        gate = device_skip if deferred is None else deferred[0]
        try:
            self._run_base_step(divisor, None if gate is None else gate.to(torch.float32))
        finally:
            self._stage = Stage.STEPPED
        if deferred is not None:
            # the collective's verdict (raises on every rank if one failed) and the values: it
            # waits for the stats' host copy, enqueued before the update, not for the update
            result.host = deferred[1]()
        if device_skip is not None:
            self.last_update_successful = None  # decided on the device: see step()'s result
            return ~device_skip, stats.total_norm, stats.num_zeros
        self.last_update_successful = True
        return result.values(True, on_host)

    def _skips_on_device(self) -> bool:
        """Whether this step can skip an update on the device: the fast Adam step will run and
        every group is fused (torch's fused kernels take ``found_inf``). Elsewhere a skip needs
        a host read of found_inf (see ``docs/concepts.md``)."""
        return (
            self._fast_token is not None
            and self._fast.ready(self.optimizer, self._table)
            and self._fast.skips_on_device()
        )

    # ------------------------------------------------------------------------------------------
    # checkpoints and grad scaler state

    def _param_records(self) -> list[ParamRecord]:
        """Every param in base-optimizer order: FQN, DTensor, and the DTensor again where the
        base optimizer steps it on this rank (None where the empty-shard filter leaves it out)."""
        self._table.sync()
        return [ParamRecord(s.fqn, s.param, s.param if s.held else None) for s in self._table.slots]

    @contextmanager
    def _held_groups(self) -> Iterator[None]:
        """With the empty-shard filter: the groups show only the params stepped on this rank,
        for the checkpoint layer (which creates state for every param it sees)."""
        slots = self._table.slots
        if all(s.held for s in slots):
            yield
            return
        groups = self.optimizer.param_groups
        saved = [list(g["params"]) for g in groups]
        try:
            for gi, g in enumerate(groups):
                g["params"][:] = self._table.held_params(gi)
            yield
        finally:
            for g, params in zip(groups, saved):
                g["params"][:] = params

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        metadata: dict | None = None,
    ) -> dict[str, Any]:
        """The fsdp_dtensor optimizer state dict (see [mfsdp_optim.checkpoint][]).

        The grad scaler's state travels separately:
        [grad_scaler_state_dict()][grad_scaler_state_dict].

        Args:
            model_sharded_state_dict: Accepted for Megatron-Core parity and ignored.
            is_loading: Build a load target: params without state first get the state their
                first step would create (or ``init_state_fn``'s).
            metadata: Accepted for Megatron-Core parity and ignored.

        Returns:
            This rank's fsdp_dtensor state dict, for ``torch.distributed.checkpoint``.
        """
        from ..checkpoint import build_sharded_state_dict

        records = self._param_records()
        self.invalidate_caches()  # init_state_fn may create or replace state
        with self._held_groups():
            return build_sharded_state_dict(
                self.optimizer, records, is_loading=is_loading, init_state_fn=self._init_state_fn
            )

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's stock torch state dict (what ``get_optimizer_state_dict`` reads).

        Raises:
            NotImplementedError: With ``OptimizerConfig(filter_empty_shards=True)``: ranks that
                filtered a param hold no state for it, so the stock layout would differ
                between ranks.
        """
        if self.config.filter_empty_shards:
            raise NotImplementedError(
                "state_dict() is not available with OptimizerConfig(filter_empty_shards=True): "
                "params with an empty local shard have no optimizer state on their rank, so the "
                "stock layout would differ between ranks. Use sharded_state_dict() with "
                "torch.distributed.checkpoint instead."
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
                [state_dict()][state_dict] or ``get_optimizer_state_dict``), handed to the
                base optimizer, or the fsdp_dtensor layout of
                [sharded_state_dict()][sharded_state_dict] (after DCP filled it),
                validated on every rank before anything changes.

        Raises:
            ValueError: The top-level keys are neither layout's.
            StateDictMismatchError: The fsdp_dtensor state dict does not fit the optimizer (a
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
                from ..checkpoint import load_sharded_state_dict

                records = self._param_records()
                load_sharded_state_dict(self.optimizer, records, state_dict)
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
            state_dict: What [grad_scaler_state_dict()][grad_scaler_state_dict] returned;
                None does nothing.

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


class _StepResult:
    """``step()``'s return values from the stats, read on the host at most once."""

    def __init__(self, stats: GradStats, host: list[float] | None = None):
        self.stats = stats
        # [found_inf, norm(, zeros)] as read with the collective's verdict (_reduce), if it was
        self.host = host

    def _read(self) -> list[float]:
        if self.host is None:  # found_inf, norm and zeros in a single transfer
            self.host = packed_values(self.stats).tolist()
        return self.host

    def found_inf(self) -> bool:
        return bool(self._read()[0])

    def values(self, ok: bool, on_host: bool) -> tuple[Any, Any, Any]:
        s = self.stats
        if not on_host:
            # a fill kernel, not a host-to-device copy
            okt = torch.full((), ok, dtype=torch.bool, device=s.found_inf.device)
            return okt, s.total_norm, s.num_zeros
        v = self._read()
        return ok, v[1], (int(v[2]) if s.num_zeros is not None else None)
