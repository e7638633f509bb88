"""``OptimizerConfig``: the wrapper's options, each validated where it is set."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping
from dataclasses import KW_ONLY, dataclass, field

import torch.distributed as dist

from ..stats.seam import check_norm_type
from ._kinds._kind_of import check_update_kinds

__all__ = ["OptimizerConfig"]


def _flag(value: object, name: str, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        also = " or None" if allow_none else ""
        raise TypeError(f"OptimizerConfig.{name} must be True or False{also}, got {value!r}")
    return value


@dataclass
class OptimizerConfig:
    """Options of [FullyShardedOptimizer][mfsdp_optim.optim.FullyShardedOptimizer].

    Attributes:
        clip_grad: Clip the global grad norm to this value before each update (0: no clipping).
        norm_type: The norm [step()][mfsdp_optim.optim.FullyShardedOptimizer.step] reports and
            clips by (any p > 0, or inf).
        log_num_zeros_in_grad: Also count zero grad elements (returned by ``step()``).
        grad_stats_group: The group grad statistics are summed over (default WORLD); it must
            hold every rank that holds a piece of any grad.
        filter_empty_shards: Keyword-only. Leave params whose local shard is empty on this rank
            out of the base optimizer's step (for base optimizers that cannot take zero-numel
            tensors); they then have no optimizer state on that rank, so the stock
            ``state_dict()`` is refused and ``sharded_state_dict()`` is the checkpoint path.
        precision_aware: Keyword-only. The base optimizer takes grads whose dtype differs from
            the param's itself, so the wrapper does not cast them. None: detect it (an
            ``mfsdp_precision_aware`` attribute on the optimizer, or Transformer Engine's
            FusedAdam with ``master_weights``/``use_decoupled_grad``).
        triton_adam_step: Keyword-only. True (the default): on CUDA, step ``torch.optim.Adam``/
            ``AdamW`` groups with ``fused=True`` through this package's Triton kernel (on
            other devices, and where it does not apply, torch's kernel runs): the clip is
            applied inside the update and the grads are not written (28 bytes per fp32
            element instead of 32 with clipping). It differs from torch's kernel
            in two ways: float32 rounding (a few ulps; at least as accurate against float64),
            and the grads keep their unclipped values after the step. False: torch's own fused
            kernel, bit-identical to stock torch, with the clipped grads left in place.
        host_sync: Keyword-only. True: ``step()`` returns Python values, which costs one
            device-to-host copy per step. False: it returns 0-d device tensors and never waits
            for the device (see "A step that does not wait for the host" in the
            documentation's Concepts page).
        cuda_graph: Keyword-only. Capture the step (stats kernel, its collective, clip, skip
            gate, scaler update, Adam/AdamW update) in a ``torch.cuda.CUDAGraph`` once and
            replay it while grads, params and state stay where they are; lr changes are read
            from device memory. Needs ``host_sync=False``, CUDA params and an NCCL grad-stats
            group. What a training loop must do for the graph to hold, and which steps stay
            eager: the documentation's Concepts page, "The captured step".
        update_kinds: Keyword-only. ``{optimizer class: "elementwise" | "whole_param"}`` for
            classes the package does not know (see the documentation's "Which optimizers run
            how" page): "elementwise" steps local shards (every element's update reads only
            that element); "whole_param" computes each param's update on the whole param.
            Unknown classes default to "whole_param" (exact), with a warning.
        clip_scope: Keyword-only. Which base optimizers ``clip_grad`` clips, and by which norm:
            ``"global"`` (the default) every one by the global norm of all grads;
            ``"per_optimizer"`` each by the norm of its own grads; a collection of base-optimizer
            indices (e.g. ``{1}`` for the AdamW of ``[Muon, AdamW]``) only those, by the norm of
            their grads together, the others unclipped. Every scope costs the same single
            collective; ``step()`` reports the global norm, ``wrapper.grad_norms`` each base
            optimizer's (see "Clipping Muon and AdamW" on the documentation's optimizers page).
        batched_newton_schulz: Keyword-only. Whether Muon's owners run Newton-Schulz once per
            matrix shape over all the matrices of that shape they own (batched matrix products)
            instead of once per matrix. ``None`` (the default): batched wherever this process
            has shown, with one probe of random matrices per kind of batch (shape, layout,
            batch size, device, hyperparameters), that the batched products give torch's
            per-matrix bits, else per matrix, so the result is always torch's. ``True``: always
            batched (on a device whose batched kernels round differently, the result may differ
            from torch's in the last bits). ``False``: never (see the documentation's optimizers
            page).
        rank_dependent_keys: Keyword-only. Param-group keys whose values may differ between
            ranks on purpose (e.g. ``("lr",)`` for a per-rank lr experiment). Every step checks,
            inside its one collective, that every rank's param groups hold the same values for
            every other key (all but ``params``); a mismatch raises
            [HyperparameterMismatchError][mfsdp_optim.errors.HyperparameterMismatchError] on
            every rank before anything changes. Empty (the default): every key is checked. Each
            rank then updates its own shards with its own values of these keys; meant for
            elementwise classes (on the whole-param path a param's update uses the values of
            the rank that computes it, see the documentation's Concepts page).
    """

    clip_grad: float = 0.0
    norm_type: float = 2.0
    log_num_zeros_in_grad: bool = False
    grad_stats_group: dist.ProcessGroup | None = None
    _: KW_ONLY
    filter_empty_shards: bool = False
    precision_aware: bool | None = None
    triton_adam_step: bool = True
    host_sync: bool = True
    cuda_graph: bool = False
    update_kinds: Mapping[type, str] = field(default_factory=dict)
    clip_scope: str | Collection[int] = "global"
    batched_newton_schulz: bool | None = None
    rank_dependent_keys: Collection[str] = ()

    def __post_init__(self) -> None:
        clip = self.clip_grad
        if isinstance(clip, bool) or not isinstance(clip, numbers.Real):
            raise TypeError(
                "OptimizerConfig.clip_grad must be a number >= 0 (0 disables clipping), "
                f"got {clip!r}"
            )
        if not (float(clip) >= 0 and math.isfinite(float(clip))):
            raise ValueError(
                "OptimizerConfig.clip_grad must be a finite number >= 0 (0 disables clipping), "
                f"got {float(clip)!r}"
            )
        self.clip_grad = float(clip)
        self.norm_type = check_norm_type(self.norm_type)
        self.log_num_zeros_in_grad = bool(
            _flag(self.log_num_zeros_in_grad, "log_num_zeros_in_grad")
        )
        # not type-checked: on ranks outside it, dist.new_group hands out a sentinel, not a group
        self.filter_empty_shards = bool(_flag(self.filter_empty_shards, "filter_empty_shards"))
        self.precision_aware = _flag(self.precision_aware, "precision_aware", allow_none=True)
        self.triton_adam_step = bool(_flag(self.triton_adam_step, "triton_adam_step"))
        self.host_sync = bool(_flag(self.host_sync, "host_sync"))
        self.cuda_graph = bool(_flag(self.cuda_graph, "cuda_graph"))
        if self.cuda_graph and self.host_sync:
            raise ValueError(
                "OptimizerConfig(cuda_graph=True) needs host_sync=False: a captured step cannot "
                "read its results on the host. Pass OptimizerConfig(cuda_graph=True, "
                "host_sync=False) and read the returned device tensors when you log them."
            )
        self.update_kinds = check_update_kinds(self.update_kinds)
        self.clip_scope = _check_clip_scope(self.clip_scope)
        self.batched_newton_schulz = _flag(
            self.batched_newton_schulz, "batched_newton_schulz", allow_none=True
        )
        self.rank_dependent_keys = _check_keys(self.rank_dependent_keys)


def _check_keys(keys: object) -> tuple[str, ...]:
    """``rank_dependent_keys`` as a sorted tuple of distinct strings."""
    if isinstance(keys, str) or not isinstance(keys, Collection):
        hint = f" (one key: ({keys!r},))" if isinstance(keys, str) else ""
        raise TypeError(
            "OptimizerConfig.rank_dependent_keys must be a collection of param-group keys "
            f"(strings), got {keys!r}{hint}"
        )
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(
            f"OptimizerConfig.rank_dependent_keys holds {bad[0]!r}, not a string: name the "
            "param-group keys whose values may differ between ranks, e.g. ('lr',)"
        )
    if "params" in keys:
        raise ValueError(
            "OptimizerConfig.rank_dependent_keys names 'params': the params are never compared "
            "between ranks (each rank holds its own shards); name hyperparameter keys only"
        )
    return tuple(sorted(set(keys)))


def _check_clip_scope(scope: object) -> str | tuple[int, ...]:
    """``"global"``, ``"per_optimizer"``, or the indices as a sorted tuple of distinct ints."""
    if isinstance(scope, str):
        if scope in ("global", "per_optimizer"):
            return scope
        raise ValueError(
            'OptimizerConfig.clip_scope must be "global", "per_optimizer" or a collection of '
            f"base-optimizer indices, got {scope!r}"
        )
    if not isinstance(scope, Collection):
        raise TypeError(
            'OptimizerConfig.clip_scope must be "global", "per_optimizer" or a collection of '
            f"base-optimizer indices (ints), got {scope!r}"
        )
    indices = list(scope)
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or int(i) < 0:
            raise TypeError(
                "OptimizerConfig.clip_scope's indices must be ints >= 0 (positions in the "
                f"wrapper's list of base optimizers), got {i!r} in {scope!r}"
            )
    if len(set(indices)) != len(indices):
        raise ValueError(f"OptimizerConfig.clip_scope lists an index twice: {scope!r}")
    return tuple(sorted(int(i) for i in indices))
