"""The wrapper layer: any ``torch.optim`` optimizer over FSDP2 (DTensor) params, at local speed.

Design
======

**Local-shard aliases.** A base optimizer stepping DTensor params pays DTensor dispatch on every
op it issues (83.5 ms vs 12.7 ms for fused AdamW on 3000 params on an H200). The wrapper therefore
swaps each entry of the base optimizer's ``param_groups[i]["params"]`` for the DTensor's plain
local shard ``p._local_tensor`` (an *alias*: the same tensor object FSDP2 writes through, zero
copy, same storage) and keeps the DTensors in its own slot table for statistics and checkpoints.
State the base optimizer already holds for a DTensor at wrap time moves to the alias key, with
DTensor state values replaced by their local tensors (zero copy).

For each step the wrapper binds ``alias.grad = <local grad>`` (after unscaling and any dtype cast),
runs the base step, and unbinds (``alias.grad = None``) so no grad memory outlives the step through
the alias. FSDP2 may replace ``p._local_tensor`` (lazy init at the first forward,
``load_state_dict(assign=True)``), so the bind loop checks ``alias is p._local_tensor`` for every
param and, if it changed, re-binds: the new local tensor takes the old one's place in its param
group and its optimizer state (the state's key moves; values are untouched). That check, the bind
and the unbind are one Python loop over the params (about 1 us per param on a CPU host; see
``benchmarks/bench_step.py``), and it is the only per-param Python work of a step besides the
prepare loop. (The Adam/AdamW fast step below replaces it.)

**Fast step** (``_fast_step``) for ``torch.optim.Adam``/``AdamW`` with ``fused=True`` or
``foreach=True``: no grad binding and no ``optimizer.step()``. The prepare loop, which visits
every param anyway, also appends each param's local work grad (unscaled, cast) to its param
group's list and checks its alias is still ``p._local_tensor``; the wrapper then calls what
``Adam.step()`` calls after ``_init_group``, per group, with lists of aliases and state tensors
(exp_avg, exp_avg_sq, max_exp_avg_sq, step) cached across steps: for a fused group on one
(device, dtype), ``torch._foreach_add_(steps, 1)`` and ``torch._fused_adam_``/``_fused_adamw_``
with the group's hyperparameters read at each step (the body of ``torch.optim.adam._fused_adam``);
otherwise the functional ``torch.optim.adam.adam(...)`` with the arguments ``Adam.step()`` passes
(foreach: ``_multi_tensor_adam``). Same kernels, same tensors, same argument values, same order:
bit-identical params and state (``tests/test_fast_step.py`` checks Adam/AdamW x fused/foreach x
amsgrad x maximize x weight_decay x float/tensor lr, with clipping, a grad scaler, bf16 grads and
the empty-shard filter). Params without a grad are left out of the lists, as ``_init_group`` does.

It applies only when ``type(optimizer)`` is exactly ``Adam`` or ``AdamW``; every group has
``fused=True`` (or ``foreach=True`` with a float lr), ``capturable=False`` and
``differentiable=False``; the base optimizer has no step pre/post hooks, no instance-level
``step`` (an lr scheduler attached to the *base* optimizer) and no ``grad_scale``/``found_inf``,
and there are no global optimizer hooks (all of these would be skipped); the grads are not
precision-aware/decoupled; and every param of every group already has its full state. Otherwise
(in particular the first step, which creates the state) the generic path runs. The cache is
rebuilt after alias re-binding, ``add_param_group``, ``load_state_dict``/``sharded_state_dict``,
``param_groups`` assignment, a new ``optimizer.state`` mapping or a change in its size, new group
dicts or params lists, or a changed ``amsgrad``; a step whose prepare loop saw a replaced local
tensor goes generic (which re-binds). Replacing one existing ``optimizer.state[p]`` entry by
hand is not detected: call ``_invalidate_fast_step()`` after it. ``MFSDP_OPTIM_DISABLE_FAST_STEP=1``
forces the generic path; ``fast_steps`` counts the steps that took the fast path.

**The step contract** (Megatron-Core's mixed-precision optimizer, on DTensors)::

    step() = prepare_grads()           unscale by 1/loss-scale, cast grads whose dtype differs
                                       from the param's, ONE grad_stats collective (norm, zeros,
                                       found_inf over config.grad_stats_group)
             -> if found_inf and a grad scaler: skip on every rank, update the scaler,
                restore grads, return (False, norm, zeros)
             -> clip (if config.clip_grad > 0): clip_grads_with_norm_'s coefficient, applied to
                the local grads prepare_grads already grouped (the coefficient stays on device),
                or folded into a fused base step (below)
             -> base optimizer step on the aliases
             -> restore grad dtypes, unbind
             -> step post hooks (e.g. refresh compute weights / FP8 scales)

found_inf comes out of the same all-reduce as the norm, so every rank of the grad-stats group sees
the same value and a step is skipped everywhere or nowhere.

**Clip folding.** A separate clip reads and writes every grad once more (8 bytes per fp32
element on top of AdamW's 28). torch's fused optimizers (``Adam``, ``AdamW``, ``SGD``,
``Adagrad`` with ``fused=True`` in every group, exact types) take a ``grad_scale`` tensor, the
slot ``torch.amp.GradScaler`` uses: their kernel divides each grad by it while it updates and
stores the divided grad back. ``step()`` hands them ``max(1, (norm + 1e-6) / clip_grad)`` there
(kept on device, no host sync), so the clip costs one grad store inside the update instead of a
pass of its own. The grads after the step hold the clipped values either way. Numerically the
fused path computes ``g / d`` where the separate clip computes ``g * (clip_grad / (norm + 1e-6))``:
the same up to the last bit of the clipped grad (``tests/test_optimizer_clip_fold.py``). Not
folded: ``clip_grad_norm()`` (it returns with the grads clipped), a base optimizer whose
``grad_scale``/``found_inf`` someone else has set, precision-aware optimizers, and everything
else. ``MFSDP_OPTIM_DISABLE_CLIP_FOLD=1`` turns folding off.
``OptimizerConfig(triton_adam_step=True)`` goes one step further for fused ``Adam``/``AdamW``
groups of large tensors on CUDA: this package's Triton kernel reads the divisor, applies it inside
the update and stores no grads (28 bytes per element, as unclipped); there the grads keep their
unclipped values after the step, and the update matches torch's kernel to float32 rounding, not
bit for bit.

**Steady-state prepare.** The prepare loop (bind each param's local grad to its alias, check dtype
and placement, find its stats bucket) costs Python per param. When a step finds nothing to cast and
every alias still is its param's local tensor, it records a plan (``_PreparePlan``); later steps
whose grads carry the same placement specs and dtypes and whose params hold the same local tensors
(checked list-wide, at C speed) replay it and skip the per-param loop. Any difference, in any
param, falls back to the full loop, which records a new plan. ``prepare_replays`` counts replays.

**Host synchronisation.** One per ``step()``: a single ``.tolist()`` of (found_inf, norm, zeros).
With a grad scaler it happens before the base step (the skip decision needs it); without one it
is deferred until the base step has been enqueued, so on GPU the host waits only for the return
values. ``prepare_grads()``, ``get_grad_norm()``, ``count_zeros()`` and ``clip_grad_norm()``
return Python numbers, so each of them syncs once.

**Grad dtype casts.** A grad whose dtype differs from its param's (bf16 grads of fp32 params) is
copied to the param dtype in ``prepare_grads``; the base optimizer sees the copy, and after the
step the (unscaled, clipped) values are copied back into the original grad, which ``p.grad`` has
held all along, and the copy is dropped. Transient memory: at most one param-dtype copy of the
local grads that differ in dtype, alive from ``prepare_grads`` until the step ends (or
``zero_grad``). A *precision-aware* base optimizer that takes low-precision grads itself skips the
cast: set ``OptimizerConfig(precision_aware=True)``, or give the optimizer an attribute
``mfsdp_precision_aware = True``; Transformer Engine's ``FusedAdam`` with ``master_weights`` or
``use_decoupled_grad`` is detected when TE is installed (never required). With
``use_decoupled_grad`` the grad is bound to ``alias.decoupled_grad``.

**Stages** (like ``torch.amp.GradScaler``): READY -> ``prepare_grads`` -> PREPARED ->
(``clip_grad_norm``) -> ``step_with_ready_grads`` -> STEPPED. ``prepare_grads`` twice (grads would
be unscaled twice) and ``step_with_ready_grads`` outside PREPARED raise RuntimeError saying what
happened. ``zero_grad`` returns to READY from any stage; a new ``prepare_grads``/``step`` after
STEPPED starts the next iteration.

**Empty-shard filter** (opt-in, ``OptimizerConfig(filter_empty_shards=True)``): params whose local
shard is empty on this rank are kept out of the base optimizer there (TE FusedAdam < 2.18 stops
updating after an empty tensor). Their grads still go to ``grad_stats`` (every rank calls it), so
collectives stay rank-consistent; ``_param_records()`` reports them with ``opt_param=None``.

**Ranks without params** (a base optimizer built with ``[{"params": []}]``) take part in every
collective with empty grad lists.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from itertools import chain
from operator import is_ as _is
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as _torch_optim_module

from ._buckets import BucketKey, layout_of
from ._clip import check_max_norm
from ._clip import clip_divisor as clip_grad_divisor
from ._clip import scale_by_clip_coef_ as scale_locals_by_clip_coef_
from ._fast_step import FastAdamStep
from ._params import ParamRecord
from ._placement import mesh_ranks_outside_group
from ._reduce import GradStats, reduce_buckets
from ._stats_math import check_norm_type
from ._triton_adam import TritonAdam
from .grad_scaler import GradScaler
from .stats import grad_stats

__all__ = ["FullyShardedOptimizer", "OptimizerConfig"]

DISABLE_CLIP_FOLD_ENV = "MFSDP_OPTIM_DISABLE_CLIP_FOLD"
# torch's fused optimizers that read ``optimizer.grad_scale`` in step() and divide every grad by
# it inside their kernel (the route torch.amp.GradScaler uses for them); exact types only: a
# subclass may override step() and ignore it, which would silently skip the clip
_GRAD_SCALE_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@dataclass
class OptimizerConfig:
    """Options of :class:`FullyShardedOptimizer`.

    clip_grad: clip the global grad norm to this value before each update (0: no clipping).
    norm_type: the norm ``step()`` reports and clips by (any p > 0, or inf).
    log_num_zeros_in_grad: also count zero grad elements (returned by ``step()``).
    grad_stats_group: the group grad statistics are summed over (default WORLD); it must hold
        every rank that holds a piece of any grad.

    Keyword-only extras (not in Megatron's config):

    filter_empty_shards: keep params whose local shard is empty out of the base optimizer on
        that rank (for base optimizers that cannot take zero-numel tensors).
    precision_aware: the base optimizer takes grads whose dtype differs from the param's itself,
        so the wrapper does not cast them. None: detect (an ``mfsdp_precision_aware`` attribute
        on the optimizer, or TE FusedAdam with ``master_weights``/``use_decoupled_grad``).
    triton_adam_step: step ``torch.optim.Adam``/``AdamW`` groups with ``fused=True`` on CUDA
        through this package's Triton kernel (``mfsdp_optim._triton_adam``) instead of torch's:
        the clip is applied inside the update and the grads are not written, 28 bytes per fp32
        element instead of 32 (with clipping). Results are not bit-identical to torch's fused
        kernel (float32 rounding differs; at least as accurate against float64), and the grads
        keep their unclipped values after the step. Groups the kernel does not take (small
        tensors, under 2**20 elements on average, where its host work costs more than it saves;
        amsgrad, tensor lr, CPU, mixed dtypes, Triton missing) use torch's kernel as before.
        Default off: bit-compatibility with torch's own fused step comes first.
    """

    clip_grad: float = 0.0
    norm_type: float = 2.0
    log_num_zeros_in_grad: bool = False
    grad_stats_group: dist.ProcessGroup | None = None
    _: KW_ONLY
    filter_empty_shards: bool = False
    precision_aware: bool | None = None
    triton_adam_step: bool = False

    def __post_init__(self) -> None:
        clip = float(self.clip_grad)
        if not (clip >= 0 and math.isfinite(clip)):
            raise ValueError(
                f"OptimizerConfig.clip_grad must be a finite number >= 0 (0 disables clipping), "
                f"got {self.clip_grad!r}"
            )
        self.clip_grad = clip
        self.norm_type = check_norm_type(self.norm_type)
        if not isinstance(self.triton_adam_step, bool):
            raise TypeError(
                f"OptimizerConfig.triton_adam_step must be True or False, "
                f"got {self.triton_adam_step!r}"
            )


_READY, _PREPARED, _STEPPED = "READY", "PREPARED", "STEPPED"


class _PreparePlan:
    """What the prepare loop found in a steady step, to replay it with a few C-level passes.

    Recorded after a step where every param had a grad, no grad needed a dtype cast and every
    alias was its param's local tensor. A later step replays it when the grads carry the same
    spec objects (FSDP2 builds every grad of a param on one spec) and dtypes and the params the
    same local tensors, checked by identity over whole lists; anything else runs the full loop,
    which validates and records a new plan. Per param that is about six list-comprehension
    element operations instead of the loop's two dozen bytecode-level steps (the difference is
    about 1.5 us per param on the device machine's host).
    """

    __slots__ = ("slots", "n", "cast_grads", "params", "specs", "dtypes", "locals",
                 "buckets", "fast_groups", "fast_lists")

    def __init__(self, slots: list[_Slot], cast_grads: bool, keys: list[BucketKey],
                 fast_groups: object):
        self.slots = slots
        self.n = len(slots)
        self.cast_grads = cast_grads
        self.params = [s.param for s in slots]
        self.specs = [s.grad_spec for s in slots]
        self.dtypes = [s.grad_dtype for s in slots]
        self.locals = [s.param._local_tensor for s in slots]
        by_key: dict[BucketKey, list[int]] = {}
        for i, key in enumerate(keys):
            by_key.setdefault(key, []).append(i)
        # None: the bucket holds every grad in slot order (the common case: no gather needed)
        self.buckets = [(k, None if len(idx) == self.n else idx) for k, idx in by_key.items()]
        self.fast_groups: object = None
        self.fast_lists: list[tuple[list[torch.Tensor], list[int] | None]] = []
        self._index_fast_lists(fast_groups)

    def _index_fast_lists(self, fast_groups: object) -> None:
        """Which slots feed which of the fast step's per-group grad lists (``_Slot.fast_list``,
        set by the fast-step cache ``fast_groups``)."""
        by_list: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        for i, s in enumerate(self.slots):
            if s.fast_list is not None:
                by_list.setdefault(id(s.fast_list), (s.fast_list, []))[1].append(i)
        self.fast_lists = [(fl, None if len(idx) == self.n else idx)
                           for fl, idx in by_list.values()]
        self.fast_groups = fast_groups

    def replay(self, wrapper: FullyShardedOptimizer, cast_grads: bool, fast: bool
               ) -> dict[BucketKey, list[torch.Tensor]] | None:
        """The buckets of this step's local grads, with each slot's ``work_grad`` set and the
        fast step's lists filled; None (nothing changed) when the plan does not apply."""
        slots = wrapper._slots
        if slots is not self.slots or len(slots) != self.n or cast_grads != self.cast_grads:
            return None
        params = self.params
        # the same grad objects, without the torch-function dispatch a tensor subclass's
        # property getter pays (about half the cost of reading .grad of a DTensor param)
        with torch._C.DisableTorchFunctionSubclass():
            grads = [p.grad for p in params]
        try:
            locals_ = [g._local_tensor for g in grads]  # type: ignore[union-attr]
        except AttributeError:  # a param without a grad this step
            return None
        if not (all(map(_is, [g._spec for g in grads], self.specs))  # type: ignore[union-attr]
                and all(map(_is, [t.dtype for t in locals_], self.dtypes))
                and all(map(_is, [p._local_tensor for p in params], self.locals))):
            return None
        for slot, g in zip(slots, grads):
            slot.work_grad = g  # type: ignore[assignment]  # a DTensor param's grad
        if fast and wrapper._fast._groups is not self.fast_groups:  # the cache was rebuilt
            self._index_fast_lists(wrapper._fast._groups)
        if fast:
            for fl, idx in self.fast_lists:
                fl.extend(locals_ if idx is None else [locals_[i] for i in idx])
        return {k: (locals_ if idx is None else [locals_[i] for i in idx])
                for k, idx in self.buckets}


class _Slot:
    """One param of the base optimizer: its DTensor and the tensor the base optimizer holds."""

    __slots__ = ("fqn", "param", "alias", "group", "work_grad", "saved_grad", "grad_spec",
                 "grad_dtype", "bucket_key", "fast_list")

    def __init__(self, fqn: str, param: DTensor, alias: torch.Tensor | None, group: dict):
        self.fqn = fqn
        self.param = param
        self.alias = alias  # None: filtered out of the base optimizer on this rank
        self.group = group
        self.work_grad: DTensor | None = None  # the grad the base step uses (PREPARED)
        self.saved_grad: DTensor | None = None  # the original grad when work_grad is a cast copy
        # the stats bucket of the last grad seen, valid while the grad keeps this spec object
        # and dtype (FSDP2 hands every grad of a param the same spec): one identity check a step
        self.grad_spec: object = None
        self.grad_dtype: torch.dtype | None = None
        self.bucket_key: BucketKey | None = None
        # the fast step's grad list of this param's group (see _fast_step); None: not cached
        self.fast_list: list[torch.Tensor] | None = None


def _te_fused_adam_types() -> tuple[type, ...]:
    types: list[type] = []
    try:  # optional accelerator, never required
        from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

        types.append(TEFusedAdam)
    except Exception:
        pass
    return tuple(types)


def _detect_precision_aware(optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
    """(precision_aware, decoupled_grad) for ``optimizer``."""
    decoupled = bool(getattr(optimizer, "use_decoupled_grad", False))
    explicit = getattr(optimizer, "mfsdp_precision_aware", None)
    if explicit is not None:
        return bool(explicit), decoupled
    te = _te_fused_adam_types()
    if te and isinstance(optimizer, te):
        return bool(getattr(optimizer, "master_weights", False)) or decoupled, decoupled
    return False, decoupled


def _fqn_map(model_chunks: Sequence[torch.nn.Module]) -> dict[int, str]:
    """id(param) -> FQN over all chunks; FQNs that collide across chunks raise ValueError."""
    by_id: dict[int, str] = {}
    owner: dict[str, int] = {}
    collisions: dict[str, list[int]] = defaultdict(list)
    for c, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            if name in owner and owner[name] != c:
                collisions[name].extend([owner[name], c])
                continue
            owner[name] = c
            by_id.setdefault(id(param), name)
    if collisions:
        desc = ", ".join(
            f"{n!r} (chunks {sorted(set(cs))})" for n, cs in sorted(collisions.items())
        )
        raise ValueError(
            f"model_chunks have colliding parameter FQNs: {desc}. Each FQN names one parameter "
            "in checkpoints; give the chunks distinct module names (e.g. wrap each chunk in a "
            "parent module with a unique attribute name)."
        )
    return by_id


class FullyShardedOptimizer(torch.optim.Optimizer):
    """Any ``torch.optim.Optimizer`` over DTensor params (FSDP2, HSDP, TP+FSDP, expert meshes).

    See the module docstring for the design: the base optimizer steps plain local-shard aliases;
    the wrapper keeps the DTensors for grad statistics (one collective per step), clipping, loss
    scaling and checkpoints. It is a ``torch.optim.Optimizer``: ``param_groups``, ``defaults`` and
    ``state`` are the base optimizer's, lr schedulers accept it, and step pre/post hooks run
    around :meth:`step`.
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
        if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
            raise TypeError(
                "grad_scaler must be a mfsdp_optim GradScaler (ConstantGradScaler or "
                f"DynamicGradScaler), got {type(grad_scaler).__name__}"
            )
        # the parts of torch.optim.Optimizer.__init__ that do not build param groups: the base
        # optimizer owns those (param_groups/state/defaults are properties below)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

        self.optimizer = optimizer
        self.config = config if config is not None else OptimizerConfig()
        self.grad_scaler = grad_scaler
        self._init_state_fn = init_state_fn
        self.model_chunks = list(model_chunks)
        aware = self.config.precision_aware
        detected, self._decoupled_grad = _detect_precision_aware(optimizer)
        self._precision_aware = detected if aware is None else bool(aware)
        self._stage = _READY
        self._stats: GradStats | None = None
        self._work_locals: dict[tuple, list[torch.Tensor]] = {}
        self._any_cast = False  # whether prepare made dtype-cast copies to restore
        self._plan: _PreparePlan | None = None  # the steady-state prepare (see _PreparePlan)
        self.last_update_successful: bool | None = None
        # the Adam/AdamW fast step (see _fast_step): its cache is valid for one _fast_version,
        # bumped whenever aliases, groups or state change through the wrapper
        self._fast = FastAdamStep()
        self._fast_version = 0
        self._fast_armed = False  # the prepare loop collected the grads for the fast step
        self._fast_stale = False  # the prepare loop saw a replaced local tensor: go generic
        self.fast_steps = 0  # steps that took the fast path (for tests and diagnostics)
        self.clip_folds = 0  # steps whose clip rode on the fused base step (likewise)
        self.prepare_replays = 0  # prepares that replayed the recorded plan (likewise)
        self._triton = TritonAdam() if self.config.triton_adam_step else None

        self._slots: list[_Slot] = []
        group = self.config.grad_stats_group
        self._in_stats_group = dist.get_rank(group) >= 0 if group is not None else True
        self._adopt_groups(optimizer.param_groups, _fqn_map(self.model_chunks), first_index=0)

    # ------------------------------------------------------------------------------------------
    # construction

    def _adopt_groups(self, groups: list[dict], fqns: dict[int, str], first_index: int) -> None:
        """Validate every param of ``groups`` and swap it for its local alias (or filter it).

        ``groups`` are ``optimizer.param_groups[first_index:]``. Everything is checked before
        anything changes: on an error the groups, the optimizer state and the slot table are as
        they were.
        """
        named = self._name_new_params(groups, fqns, first_index)
        self._check_stats_group(named)
        self._fast_version += 1
        state = self.optimizer.state
        filt = self.config.filter_empty_shards
        names = iter(named)
        for group in groups:
            kept: list[torch.Tensor] = []
            for p in group["params"]:
                fqn, _ = next(names)
                local = p._local_tensor
                if filt and local.numel() == 0:
                    state.pop(p, None)
                    self._slots.append(_Slot(fqn, p, None, group))
                    continue
                if p in state:
                    st = state.pop(p)
                    state[local] = {
                        k: (v._local_tensor if isinstance(v, DTensor) else v)
                        for k, v in st.items()
                    }
                kept.append(local)
                self._slots.append(_Slot(fqn, p, local, group))
            group["params"] = kept

    def _name_new_params(
        self, groups: list[dict], fqns: dict[int, str], first_index: int
    ) -> list[tuple[str, DTensor]]:
        """``(fqn, param)`` for every param of ``groups``, in order; raises on bad params.

        A param without a model_chunks FQN (no model_chunks given) is named by its position,
        ``param_groups.<g>.params.<j>``, with ``g`` counted over all groups of the optimizer.
        """
        missing: list[str] = []
        named: list[tuple[str, DTensor]] = []
        for g, group in enumerate(groups, start=first_index):
            for j, p in enumerate(group["params"]):
                if not isinstance(p, DTensor):
                    raise TypeError(
                        f"param_groups[{g}]['params'][{j}] is a {type(p).__name__}, expected a "
                        "DTensor: FullyShardedOptimizer wraps optimizers over FSDP2 (fully_shard) "
                        "params. Build the optimizer after fully_shard(model), from "
                        "model.parameters()."
                    )
                if self.model_chunks and id(p) not in fqns:
                    missing.append(
                        f"param_groups[{g}]['params'][{j}] (shape {tuple(p.shape)}, "
                        f"mesh dims {p.device_mesh.mesh_dim_names})"
                    )
                named.append((fqns.get(id(p), f"param_groups.{g}.params.{j}"), p))
        if missing:
            raise ValueError(
                f"{len(missing)} optimizer params are missing from model_chunks: "
                f"{'; '.join(missing)}. Pass every module whose parameters the optimizer "
                "updates in model_chunks (FQNs come from their named_parameters())."
            )
        held = {id(s.param): s.fqn for s in self._slots}
        names = set(held.values())
        for fqn, p in named:
            if id(p) in held:
                raise ValueError(
                    f"the optimizer already holds the parameter {held[id(p)]!r}; a parameter "
                    f"can be in one param group only (got it again as {fqn!r})."
                )
            if fqn in names:
                raise ValueError(
                    f"the optimizer holds two parameters named {fqn!r}: names key the "
                    "checkpoint, so they must be unique. Pass model_chunks so that params are "
                    "named by their FQNs."
                )
            held[id(p)] = fqn
            names.add(fqn)
        return named

    def _check_stats_group(self, new: list[tuple[str, DTensor]]) -> None:
        """Every rank holding a shard of a new param must be in the grad-stats group."""
        group = self.config.grad_stats_group
        seen: set[int] = set()
        for fqn, p in new:
            mesh = p.device_mesh
            if id(mesh) in seen:
                continue
            seen.add(id(mesh))
            outside = mesh_ranks_outside_group(mesh, group)
            if outside:
                raise ValueError(
                    f"OptimizerConfig.grad_stats_group misses ranks {outside} that hold shards "
                    f"of {fqn!r} (mesh {mesh}); their grads would be left out of the norm and "
                    "the overflow check. Use a group that spans every rank holding grads "
                    "(default: WORLD)."
                )
        if (new or self._slots) and not self._in_stats_group:
            raise ValueError(
                f"rank {dist.get_rank()} holds params but is not in "
                "OptimizerConfig.grad_stats_group; every rank holding grads must be in it."
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of DTensor params; the base optimizer gets their local aliases.

        Validated like the constructor's groups; on an error nothing is added.
        """
        before = len(self.optimizer.param_groups)
        self.optimizer.add_param_group(param_group)
        try:
            self._adopt_groups(
                self.optimizer.param_groups[before:], _fqn_map(self.model_chunks), before
            )
        except Exception:
            del self.optimizer.param_groups[before:]
            raise

    # ------------------------------------------------------------------------------------------
    # torch.optim.Optimizer surface

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._fast_version += 1
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def state(self):  # type: ignore[override]
        """The base optimizer's state, keyed by the local aliases."""
        return self.optimizer.state

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "FullyShardedOptimizer is not picklable; checkpoint it with sharded_state_dict()"
        )

    def __repr__(self) -> str:
        return f"FullyShardedOptimizer({self.optimizer!r}, config={self.config!r})"

    # ------------------------------------------------------------------------------------------
    # aliases and grads

    def _refresh_aliases(self) -> None:
        for s in self._slots:
            if s.alias is not None and s.param._local_tensor is not s.alias:
                self._rebind(s)

    def _rebind(self, s: _Slot) -> None:
        """FSDP2 replaced ``s.param._local_tensor``: hand the base optimizer the new one."""
        old, new = s.alias, s.param._local_tensor
        assert old is not None  # only slots the base optimizer holds have an alias to rebind
        self._fast_version += 1
        params = s.group["params"]
        for i, q in enumerate(params):
            if q is old:
                params[i] = new
                break
        state = self.optimizer.state
        if old in state:
            state[new] = state.pop(old)
        s.alias = new

    def _current_grads(self) -> list[DTensor]:
        """The grads statistics and clipping act on now (the cast copies while PREPARED)."""
        if self._stage == _PREPARED:
            return [s.work_grad for s in self._slots if s.work_grad is not None]
        # a DTensor param's grad is a DTensor (torch types ``.grad`` as a plain Tensor)
        return [cast(DTensor, s.param.grad) for s in self._slots if s.param.grad is not None]

    def _stats_of(self, grads: list[DTensor], count_zeros: bool) -> GradStats:
        if not self._in_stats_group:  # a paramless rank outside the group: nothing to add
            zero = torch.zeros((), dtype=torch.float32)
            return GradStats(zero, torch.zeros((), dtype=torch.int64) if count_zeros else None,
                             torch.zeros((), dtype=torch.bool))
        return grad_stats(
            grads,
            norm_type=self.config.norm_type,
            count_zeros=count_zeros,
            group=self.config.grad_stats_group,
        )

    def _prepare(self) -> GradStats:
        """Unscale, cast, and take the stats; no host synchronisation."""
        if self._stage == _PREPARED:
            raise RuntimeError(
                "prepare_grads() was already called for this step (the grads are already "
                "unscaled); call step_with_ready_grads() or zero_grad() before preparing again."
            )
        cast_grads = not self._precision_aware
        scaler = self.grad_scaler
        unscale = scaler is not None and scaler.get_scale() != 1.0
        group = self.config.grad_stats_group
        self._any_cast = False
        fast = self._fast_armed = self._fast.begin(self)
        self._fast_stale = False

        def bucket_work_grads() -> dict[BucketKey, list[torch.Tensor]]:
            if fast:
                self._fast.clear()
            plan = self._plan
            buckets = None if plan is None else plan.replay(self, cast_grads, fast)
            if buckets is None:
                buckets = full_loop()
            else:
                self._fast_stale = False
                self.prepare_replays += 1
            if unscale:
                assert scaler is not None
                by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
                for (device, *_), tensors in buckets.items():
                    by_device[device].extend(tensors)
                for device, tensors in by_device.items():
                    # computes in fp32 for any grad dtype; its own found_inf is unused (the
                    # stats collective decides, for every rank of the group together)
                    scratch = torch.zeros(1, dtype=torch.float32, device=device)
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        tensors, scratch, scaler.inv_scale_on(device)
                    )
            self._work_locals = buckets
            return buckets

        def full_loop() -> dict[BucketKey, list[torch.Tensor]]:
            # the per-param loop of prepare: cast, validate (cached per layout), bucket, and
            # (fast step) collect each group's grads and check its alias; records a plan
            self._plan = None
            buckets: dict[BucketKey, list[torch.Tensor]] = defaultdict(list)
            keys: list[BucketKey] = []
            stale = False
            for i, s in enumerate(self._slots):
                g = cast("DTensor | None", s.param.grad)  # a DTensor param's grad is a DTensor
                s.saved_grad = None
                s.work_grad = g
                fl = s.fast_list if fast else None
                if fl is not None and s.param._local_tensor is not s.alias:
                    stale = True  # FSDP2 replaced the local tensor: the generic step rebinds
                if g is None:
                    continue
                local = g._local_tensor
                key = s.bucket_key
                if g._spec is not s.grad_spec or local.dtype is not s.grad_dtype:
                    info = layout_of(g, i, group)  # validates; cached per spec
                    dtype = s.param.dtype if cast_grads else local.dtype
                    key = s.bucket_key = (local.device, dtype, info.replication, info.canonical)
                    s.grad_spec, s.grad_dtype = g._spec, local.dtype
                # set above the first time: grad_spec starts as None, which no grad's spec is
                assert key is not None
                if cast_grads and local.dtype is not key[1]:
                    s.saved_grad = g
                    local = local.to(key[1])
                    s.work_grad = DTensor.from_local(
                        local, g.device_mesh, g.placements, run_check=False,
                        shape=g.shape, stride=g.stride(),
                    )
                    self._any_cast = True
                buckets[key].append(local)
                keys.append(key)
                if fl is not None:
                    fl.append(local)
            self._fast_stale = stale
            if (len(keys) == len(self._slots) and not self._any_cast and not stale
                    and all(s.alias is None or s.param._local_tensor is s.alias
                            for s in self._slots)):
                self._plan = _PreparePlan(self._slots, cast_grads, keys,
                                          self._fast._groups if fast else None)
            return buckets

        self._work_locals = {}
        if self._in_stats_group:
            try:
                buckets: Any = bucket_work_grads()
            except (TypeError, ValueError) as exc:
                buckets = exc  # joins the collective, then raises
            stats = reduce_buckets(
                buckets,
                norm_type=self.config.norm_type,
                count_zeros=self.config.log_num_zeros_in_grad,
                group=group,
            )
        else:  # a paramless rank outside the group: nothing to add, nobody to wait for
            bucket_work_grads()
            stats = self._stats_of([], self.config.log_num_zeros_in_grad)
        self._stats = stats
        self._stage = _PREPARED
        return stats

    def _clip_work_grads_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """``clip_grads_with_norm_`` on the prepared local grads, which ``_prepare`` has already
        validated and grouped by (device, dtype): same coefficient,
        ``min(1, max_norm / (total_norm + 1e-6))``, kept on device, one multi-tensor multiply
        per group, without re-validating every grad (about 5 us per grad on a CPU host)."""
        scale_locals_by_clip_coef_(self._work_locals, max_norm, total_norm)

    def _check_hyperparameters(self) -> None:
        """Refuse a non-finite lr or weight_decay (a scheduler bug) before it reaches the params.

        Python numbers and CPU tensors are checked; an accelerator tensor lr (capturable or
        fused optimizers) is left alone, since reading it would synchronise with the device.
        """
        for i, group in enumerate(self.optimizer.param_groups):
            for key in ("lr", "weight_decay"):
                value = group.get(key)
                if value is None or (torch.is_tensor(value) and value.device.type != "cpu"):
                    continue
                if not math.isfinite(float(value)):
                    raise ValueError(
                        f"param_groups[{i}][{key!r}] is {float(value)}: stepping would turn every "
                        "param of the group into NaN. Fix the value (or the lr scheduler that set "
                        "it); nothing was updated."
                    )

    def _clip_fold_ok(self) -> bool:
        """True when the clip can ride on the base step as its ``grad_scale`` divisor (see
        "Clip folding" in the module docstring)."""
        opt = self.optimizer
        if type(opt) not in _GRAD_SCALE_TYPES or os.environ.get(DISABLE_CLIP_FOLD_ENV) == "1":
            return False
        if self._precision_aware or self._decoupled_grad:
            return False
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return False  # somebody else (torch.amp.GradScaler) uses the slot
        return bool(opt.param_groups) and all(
            g.get("fused") and not g.get("differentiable") for g in opt.param_groups)

    def _bind_and_step(self, grad_divisor: torch.Tensor | None = None) -> None:
        """Bind the work grads to the aliases, run the base step, unbind, restore dtypes.

        The Adam/AdamW fast step (see ``_fast_step``) replaces bind, base step and unbind when
        the prepare loop collected the grads for it and nothing has changed since.
        ``grad_divisor``: a folded clip (``_clip_fold_ok()`` was True), handed to the fused
        base step as its ``grad_scale``."""
        self._check_hyperparameters()
        if self._fast_armed and not self._fast_stale and self._fast.ready(self):
            self._fast_armed = False
            try:
                self._fast.step(self.optimizer, {k[0] for k in self._work_locals}, grad_divisor,
                                self._triton)
                self.fast_steps += 1
            finally:
                self._restore_grads()
            return
        self._fast_armed = False
        self._fast.clear()
        decoupled = self._decoupled_grad
        bound: list[torch.Tensor] = []
        for s in self._slots:
            alias = s.alias
            if alias is None:
                continue
            if s.param._local_tensor is not alias:
                self._rebind(s)
                alias = s.alias
                assert alias is not None  # _rebind set it to the param's new local tensor
            wg = s.work_grad
            if wg is None:
                continue
            lg = wg._local_tensor
            if decoupled:
                alias.decoupled_grad = lg  # type: ignore[attr-defined]  # TE's attribute
            else:
                if lg.dtype != alias.dtype:  # precision-aware optimizer taking low-precision
                    alias.grad_dtype = None
                alias.grad = lg
            bound.append(alias)
        opt = self.optimizer
        try:
            if grad_divisor is not None:
                opt.grad_scale = grad_divisor  # type: ignore[attr-defined]  # read by step()
            opt.step()
        finally:
            if grad_divisor is not None:
                del opt.grad_scale  # type: ignore[attr-defined]
            if decoupled:
                for a in bound:
                    a.decoupled_grad = None  # type: ignore[attr-defined]  # TE's attribute
            else:
                for a in bound:
                    a.grad = None
            self._restore_grads()

    def _restore_grads(self) -> None:
        """Copy cast grads back into the original grads and drop the copies."""
        self._fast.clear()
        if not self._any_cast:
            for s in self._slots:
                s.work_grad = None
            self._work_locals = {}
            return
        dst: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        src: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for s in self._slots:
            if s.saved_grad is not None and s.work_grad is not None:
                d = s.saved_grad._local_tensor
                key = (d.device, d.dtype)
                dst[key].append(d)
                src[key].append(s.work_grad._local_tensor)
            s.work_grad = None
            s.saved_grad = None
        self._work_locals = {}
        for key in dst:
            torch._foreach_copy_(dst[key], src[key])

    def _check_ready_for_step(self, what: str) -> None:
        if self._stage != _PREPARED:
            hint = (
                "the grads were already used by a step; run backward (and zero_grad) for the "
                "next one"
                if self._stage == _STEPPED
                else "call prepare_grads() first"
            )
            raise RuntimeError(f"{what} called in stage {self._stage}: {hint}.")

    # ------------------------------------------------------------------------------------------
    # public step API

    def prepare_grads(self) -> bool:
        """Unscale and cast the grads and agree on non-finite values; returns found_inf.

        found_inf is the same on every rank of the grad-stats group. One collective, one host
        sync (for the returned bool).
        """
        return bool(self._prepare().found_inf)

    def step_with_ready_grads(self) -> bool:
        """The base optimizer step on prepared grads (no clipping); restores grad dtypes.

        Returns True (the update ran). Call after :meth:`prepare_grads`.
        """
        self._check_ready_for_step("step_with_ready_grads()")
        try:
            self._bind_and_step()
        finally:
            self._stage = _STEPPED
        return True

    def get_grad_norm(self) -> float:
        """The global ``config.norm_type`` norm of the current grads (one collective)."""
        return float(self._stats_of(self._current_grads(), False).total_norm)

    def count_zeros(self) -> int:
        """Zero elements of the current global grads, each counted once (one collective)."""
        stats = self._stats_of(self._current_grads(), True)
        assert stats.num_zeros is not None
        return int(stats.num_zeros)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the current grads to ``max_norm`` globally; returns the pre-clip norm."""
        grads = self._current_grads()
        norm = self._stats_of(grads, False).total_norm
        by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            local = g._local_tensor
            by_key[(local.device, local.dtype)].append(local)
        scale_locals_by_clip_coef_(by_key, check_max_norm(max_norm), norm)
        return float(norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the DTensor params' grads (and any cast copies); back to stage READY."""
        for s in self._slots:
            s.work_grad = None
            s.saved_grad = None
        self._work_locals = {}
        self._fast.clear()
        self._fast_armed = False
        if set_to_none:
            for s in self._slots:
                s.param.grad = None
        else:
            by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for s in self._slots:
                g = cast("DTensor | None", s.param.grad)  # a DTensor param's grad is a DTensor
                if g is not None:
                    local = g._local_tensor
                    by_key[(local.device, local.dtype)].append(local)
            for tensors in by_key.values():
                torch._foreach_zero_(tensors)
        self._stage = _READY
        self._stats = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (the loss itself without a grad scaler)."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale_on(loss.device).to(loss.dtype)

    def get_loss_scale(self) -> torch.Tensor:
        """The loss scale as a 0-d float32 tensor (1.0 without a grad scaler)."""
        if self.grad_scaler is None:
            return torch.ones((), dtype=torch.float32)
        return self.grad_scaler.scale

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> tuple[bool, float, int | None]:  # type: ignore[override]
        """One training step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``.

        grad_norm is the global norm before clipping (non-finite when the step was skipped);
        num_zeros is None unless ``config.log_num_zeros_in_grad``. Step pre-hooks run first and
        post-hooks last (also after a skipped step; ``last_update_successful`` tells which).
        ``closure``, if given, is called first with grad enabled (it should run backward).
        """
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        for hook in chain(
            _torch_optim_module._global_optimizer_pre_hooks.values(),
            self._optimizer_step_pre_hooks.values(),
        ):
            # as torch.optim.Optimizer does: args include the optimizer itself
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"a step pre-hook must return None or (new_args, new_kwargs), got {result}"
                    )
                args, kwargs = result
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            with torch.enable_grad():
                closure()

        out = self._step_impl()

        for hook in chain(
            _torch_optim_module._global_optimizer_post_hooks.values(),
            self._optimizer_step_post_hooks.values(),
        ):
            hook(self, args, kwargs)
        return out

    def _step_impl(self) -> tuple[bool, float, int | None]:
        if self._stage == _PREPARED:
            raise RuntimeError(
                "step() called after prepare_grads(): the grads are already prepared; finish "
                "with step_with_ready_grads() (or zero_grad() to drop them)."
            )
        stats = self._prepare()
        with_zeros = stats.num_zeros is not None
        values = [stats.found_inf, stats.total_norm]
        if stats.num_zeros is not None:  # i.e. with_zeros
            values.append(stats.num_zeros)

        def host_values() -> tuple[bool, float, int | None]:
            # the step's one host sync: found_inf, norm and zeros in a single transfer
            v = torch.stack([t.to(torch.float64) for t in values]).tolist()
            return bool(v[0]), v[1], (int(v[2]) if with_zeros else None)

        scaler = self.grad_scaler
        if scaler is not None:
            found_inf, norm, zeros = host_values()
            scaler.update(found_inf)
            if found_inf:
                self._restore_grads()
                self._stage = _STEPPED
                self.last_update_successful = False
                return False, norm, zeros
        divisor = None
        if self.config.clip_grad > 0:
            if self._clip_fold_ok():
                divisor = clip_grad_divisor(self.config.clip_grad, stats.total_norm)
                self.clip_folds += 1
            else:
                self._clip_work_grads_(self.config.clip_grad, stats.total_norm)
        try:
            self._bind_and_step(divisor)
        finally:
            self._stage = _STEPPED
        if scaler is None:
            found_inf, norm, zeros = host_values()
        self.last_update_successful = True
        return True, norm, zeros

    # ------------------------------------------------------------------------------------------
    # checkpoint layer and grad scaler state

    def _param_records(self) -> list[ParamRecord]:
        """Every param in base-optimizer order: FQN, DTensor, and the tensor the base optimizer
        holds for it now (None where the empty-shard filter dropped it on this rank)."""
        self._refresh_aliases()
        return [ParamRecord(s.fqn, s.param, s.alias) for s in self._slots]

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        metadata: dict | None = None,
    ) -> dict[str, Any]:
        """The fsdp_dtensor optimizer state dict (see ``mfsdp_optim.checkpoint``).

        ``model_sharded_state_dict`` and ``metadata`` are accepted for Megatron-Core parity and
        ignored. The grad scaler's state travels separately: :meth:`grad_scaler_state_dict`.
        """
        from .checkpoint import build_sharded_state_dict

        self._invalidate_fast_step()  # init_state_fn may create or replace state
        return build_sharded_state_dict(
            self.optimizer,
            self._param_records(),
            is_loading=is_loading,
            init_state_fn=self._init_state_fn,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict made by :meth:`sharded_state_dict` (after DCP filled it)."""
        from .checkpoint import load_sharded_state_dict

        self._invalidate_fast_step()
        try:
            load_sharded_state_dict(self.optimizer, self._param_records(), state_dict)
        finally:
            self._invalidate_fast_step()

    def _invalidate_fast_step(self) -> None:
        """Drop the fast step's cached lists (rebuilt at the next step). The wrapper calls this
        itself; call it after replacing an entry of ``optimizer.state`` by hand."""
        self._fast_version += 1
        self._fast.invalidate()
        self._fast_armed = False

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "FullyShardedOptimizer.state_dict() is not supported: a plain state dict would drop "
            "the sharding layout. Use sharded_state_dict() with torch.distributed.checkpoint "
            "(and grad_scaler_state_dict() for the loss scale)."
        )

    def grad_scaler_state_dict(self) -> dict[str, Any] | None:
        """The grad scaler's state (plain numbers, equal on every rank), or None."""
        return None if self.grad_scaler is None else self.grad_scaler.state_dict()

    def load_grad_scaler_state_dict(self, state_dict: dict[str, Any] | None) -> None:
        if state_dict is None:
            return
        if self.grad_scaler is None:
            raise ValueError(
                "got grad scaler state but this FullyShardedOptimizer has no grad_scaler; pass "
                "one at construction"
            )
        self.grad_scaler.load_state_dict(state_dict)
