"""Stage 1 of the build: the state a class's first step creates, without a real step.

Map: ``first_step_state`` (the stage's one entry) materialises state when loading and returns,
per dtype of the params this rank's optimizer does not hold, the tensor signature their first
step would create (``derive_signature``: one zero-element step of a scratch copy per dtype).
``materialize_optimizer_state`` gives every param without state its state by running the
class's own ``step`` once on ``scratch_copy``, a shallow copy stepping zero clones of those
params (local shards of DTensors, aligned entries in ``_infra.group_lists``), then hands the
state to the live optimizer with ``step`` reset to 0; the live params and hyperparameters are
checked unchanged. Where that local step makes non-shard-shaped state or fails (whole-param
classes such as Adafactor), the class steps a zero tensor of the param's global shape instead.
Not for LBFGS or SparseAdam: pass ``init_state_fn``. Why not torch's lr=0 step:
docs/internals.md, "Inside the checkpoint layer". ``scratch_copy`` the shallow copy every
scratch step here uses.

Imports: the leaves ``_values`` and ``_infra``; no other stage of the build (the walk:
``_build_sharded_state_dict``'s map).
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..._infra.group_lists import aligned_lists
from ..._infra.params import ParamRecord
from ..._infra.placement import as_stock_value, in_layout_of
from ._values import dtype_name

__all__ = [
    "Signature",
    "derive_signature",
    "first_step_state",
    "materialize_optimizer_state",
    "scratch_copy",
]

Signature = tuple[tuple[str, str], ...]  # sorted (state key, dtype name) of tensor state


def first_step_state(
    optimizer: torch.optim.Optimizer,
    records: Sequence[ParamRecord],
    *,
    is_loading: bool,
    init_state_fn: Callable[[torch.optim.Optimizer], None] | None,
) -> dict[torch.dtype, Signature]:
    """Stage 1 of ``build_sharded_state_dict``. With ``is_loading``, give every param of
    ``optimizer`` without state the state its first step would create (``init_state_fn``'s
    instead when given); then, per dtype of the ``records`` this rank's optimizer does not hold
    (the empty-shard filter dropped them), the signature ``derive_signature`` learns from the
    class's defaults (a handful of zero-element steps at most). Purely local: no collective."""
    if is_loading:
        if init_state_fn is not None:
            init_state_fn(optimizer)
        else:
            materialize_optimizer_state(optimizer)
    derived: dict[torch.dtype, Signature] = {}
    for rec in records:
        if rec.opt_param is None and rec.param.dtype not in derived:
            derived[rec.param.dtype] = derive_signature(
                optimizer, optimizer.defaults, rec.param.dtype
            )
    return derived


def scratch_copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` with its own empty state and no step hooks, for stepping
    other params with the class's own ``step``. Every attribute is shared (``copy.copy`` would
    keep only what ``Optimizer.__getstate__`` names: defaults, state, param_groups, and so drop
    e.g. apex FusedAdam's ``capturable`` and ``param_groups_master``); the caller sets
    ``param_groups`` (and any list kept beside them) before stepping it."""
    scratch = object.__new__(type(optimizer))
    scratch.__dict__.update(optimizer.__dict__)
    scratch.state = defaultdict(dict)
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    return scratch


def derive_signature(
    optimizer: torch.optim.Optimizer,
    group: dict,
    dtype: torch.dtype,
) -> Signature:
    """The parameter-shaped state keys and dtypes that ``type(optimizer)``'s first step creates
    for a param of ``dtype`` in a group with ``group``'s hyperparameters, learned by stepping a
    scratch copy on ONE zero-element param (nothing of ``optimizer`` is touched). Keys whose first
    step creates none (SGD without momentum) give ``()``; an optimizer that cannot be stepped this
    way (a closure, sparse grads) gives ``(("?", "?"),)``, which never matches a real signature, so
    the agreement falls back to learning the keys from the ranks that hold them."""
    scratch = scratch_copy(optimizer)
    p = torch.zeros(0, dtype=dtype)
    p.grad = torch.zeros_like(p)
    scratch.param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}]
    try:
        with torch.no_grad():
            type(optimizer).step(scratch)
    except Exception:  # noqa: BLE001 - any failure just means "learn it from the owners"
        return (("?", "?"),)
    new = scratch.state.get(p) or {}
    return tuple(
        sorted(
            (k, dtype_name(v.dtype))
            for k, v in new.items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape
        )
    )


def _snapshot(optimizer: torch.optim.Optimizer) -> list[dict]:
    out = []
    for g in optimizer.param_groups:
        snap = {}
        for k, v in g.items():
            if k == "params":
                continue
            snap[k] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        out.append(snap)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN hyperparameters compare equal to themselves


def _zero_step(value):
    if isinstance(value, torch.Tensor):
        return value.zero_()
    return type(value)(0)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor.detach() if isinstance(p, DTensor) else p.detach()


def _scratch_entry(entry: object, clone: torch.Tensor) -> object:
    """A scratch stand-in, for ``clone``, of one entry of a list kept beside the groups."""
    if isinstance(entry, torch.Tensor):
        return torch.zeros_like(clone, dtype=entry.dtype)
    return entry


def _as_stock(key: str, value: object, param: torch.Tensor, clone: torch.Tensor) -> object:
    if isinstance(param, DTensor):
        return as_stock_value(key, value, param, clone)
    return value


def _scratch_step(
    optimizer: torch.optim.Optimizer,
    beside: list[tuple[str, list[list]]],
    picks: list[list[tuple[int, torch.Tensor]]],
) -> tuple[torch.optim.Optimizer, list[dict]]:
    """A scratch copy of ``optimizer`` stepped once by its class on ``picks[gi]``: ``(position in
    group gi, zero tensor)`` pairs, each given a zero grad; returns it and its param groups."""
    scratch = scratch_copy(optimizer)
    groups = []
    scratch_beside: list[list[dict]] = [[] for _ in beside]
    for gi, (g, picked) in enumerate(zip(optimizer.param_groups, picks, strict=True)):
        if not picked:
            continue
        for _, c in picked:
            c.grad = torch.zeros_like(c)
        groups.append({**g, "params": [c for _, c in picked]})
        for (_, lists), out in zip(beside, scratch_beside, strict=True):
            out.append({"params": [_scratch_entry(lists[gi][j], c) for j, c in picked]})
    scratch.param_groups = groups
    for (attr, _), value in zip(beside, scratch_beside, strict=True):
        setattr(scratch, attr, value)
    try:
        type(optimizer).step(scratch)  # the class's step: bypasses instance patches
    except Exception as exc:
        raise RuntimeError(
            f"could not materialise the state of {type(optimizer).__name__} by stepping a "
            f"scratch copy ({type(exc).__name__}: {exc}); pass init_state_fn= to create its "
            "state instead"
        ) from exc
    return scratch, groups


def _reads_whole(new: dict, local: torch.Tensor) -> bool:
    """True when a step on ``local`` (a local shard's clone) created a tensor that is neither
    shaped like it nor 0-d: state whose shape depends on the whole param (Adafactor's factors)."""
    return any(
        isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != local.shape for v in new.values()
    )


def _materialize_whole(
    optimizer: torch.optim.Optimizer, beside: list[tuple[str, list[list]]], params: list[DTensor]
) -> None:
    """State for DTensor ``params`` whose state is not shaped like their local shards, laid out
    as the wrapper's whole-param step keeps it (``optim._whole``): the class steps a zero clone
    of the GLOBAL shape once per distinct (group, shape, dtype); parameter-shaped results become
    this rank's piece in the param's layout (``distribute_tensor`` with ``src_data_rank=None``:
    a local slice, no collective), other tensors Replicate DTensors on the param's mesh, 0-d
    tensors and plain values stay as they are (``step`` 0). Purely local."""
    position = {
        id(p): (gi, j)
        for gi, g in enumerate(optimizer.param_groups)
        for j, p in enumerate(g["params"])
    }
    template: dict[tuple, torch.Tensor] = {}
    picks: list[list[tuple[int, torch.Tensor]]] = [[] for _ in optimizer.param_groups]
    key_of: dict[int, tuple] = {}
    for p in params:
        gi, j = position[id(p)]
        key = (gi, tuple(p.shape), p.dtype)
        key_of[id(p)] = key
        if key not in template:
            full = torch.zeros(p.shape, dtype=p.dtype, device=p._local_tensor.device)
            template[key] = full
            picks[gi].append((j, full))
    with torch.no_grad():
        scratch, _ = _scratch_step(optimizer, beside, picks)
        for p in params:
            full = template[key_of[id(p)]]
            mesh, placements = p.device_mesh, p.placements
            entry = {}
            for k, v in (scratch.state.get(full) or {}).items():
                if k == "step":
                    entry[k] = _zero_step(v.clone() if isinstance(v, torch.Tensor) else v)
                elif not isinstance(v, torch.Tensor) or v.dim() == 0:
                    entry[k] = v.clone() if isinstance(v, torch.Tensor) else v
                elif v.shape == p.shape and not isinstance(v, DTensor):
                    piece = distribute_tensor(v, mesh, placements, src_data_rank=None)
                    entry[k] = in_layout_of(piece._local_tensor.clone(), p)
                else:
                    replicate = [Replicate()] * mesh.ndim
                    entry[k] = DTensor.from_local(v.clone(), mesh, replicate, run_check=False)
            if entry:
                optimizer.state[p] = entry


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every param of ``optimizer`` that has no state the state its first step would create,
    with ``step`` = 0, leaving params, param groups and existing state untouched.

    The live optimizer never steps: a scratch copy of it steps zero clones of the state-less
    params once (one param-sized buffer per such param for the duration), and their state is
    handed over. Purely local: no collective.

    Args:
        optimizer: The base optimizer; its state gains entries for the params that had none.

    Raises:
        RuntimeError: The scratch step failed (an optimizer whose ``step`` needs a closure, such
            as LBFGS, or sparse grads, such as SparseAdam: pass ``init_state_fn`` to
            [build_sharded_state_dict][mfsdp_optim.checkpoint.build_sharded_state_dict]
            instead).
    """
    missing = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not missing:
        return
    missing_ids = {id(p) for p in missing}
    versions = [(p, p._version) for g in optimizer.param_groups for p in g["params"]]
    before = _snapshot(optimizer)
    beside = aligned_lists(optimizer)
    with torch.no_grad():
        clones, picks = _zero_clones(optimizer, missing_ids)
        scratch, groups = _step_scratch(optimizer, beside, picks, missing)
    whole = _hand_over(optimizer, scratch, clones, missing)
    if whole:
        _materialize_whole(optimizer, beside, whole)
    _zero_group_steps(optimizer, missing_ids, groups, before)
    _check_untouched(optimizer, versions, before)


def _zero_clones(
    optimizer: torch.optim.Optimizer, missing_ids: set[int]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[list[tuple[int, torch.Tensor]]]]:
    """A zero clone of each state-less param's local tensor: the (clone, param) pairs in order,
    and per group the (position, clone) pairs the scratch step steps."""
    clones: list[tuple[torch.Tensor, torch.Tensor]] = []
    picks: list[list[tuple[int, torch.Tensor]]] = []
    for g in optimizer.param_groups:
        picked = []
        for j, p in enumerate(g["params"]):
            if id(p) not in missing_ids:
                continue
            c = torch.zeros_like(_local(p))
            clones.append((c, p))
            picked.append((j, c))
        picks.append(picked)
    return clones, picks


def _step_scratch(
    optimizer: torch.optim.Optimizer,
    beside: list[tuple[str, list[list]]],
    picks: list[list[tuple[int, torch.Tensor]]],
    missing: list[torch.Tensor],
) -> tuple[torch.optim.Optimizer | None, list[dict]]:
    """The scratch copy after its one step over the clones, and its groups; None (with copies
    of the live groups that have clones) where that local step failed on DTensor params (e.g.
    Adafactor divides by the numel of an empty local shard): they step whole params instead."""
    try:
        return _scratch_step(optimizer, beside, picks)
    except RuntimeError:
        if not all(isinstance(p, DTensor) for p in missing):
            raise
        groups = [
            dict(g) for g, picked in zip(optimizer.param_groups, picks, strict=True) if picked
        ]
        return None, groups


def _hand_over(
    optimizer: torch.optim.Optimizer,
    scratch: torch.optim.Optimizer | None,
    clones: list[tuple[torch.Tensor, torch.Tensor]],
    missing: list[torch.Tensor],
) -> list[DTensor]:
    """The scratch step's state handed to the live optimizer (``step`` reset to 0, the rest in
    the param's stock layout); returns the DTensor params that need a whole-param step instead
    (every one where the scratch step failed, or whose new state reads the whole param)."""
    if scratch is None:
        return [p for p in missing if isinstance(p, DTensor)]  # all are: _step_scratch checked
    whole: list[DTensor] = []
    for c, p in clones:
        new = scratch.state.get(c)
        if not new:
            continue  # this optimizer keeps no state for it (SGD without momentum)
        if isinstance(p, DTensor) and _reads_whole(new, c):
            whole.append(p)
            continue
        optimizer.state[p] = {
            k: (_zero_step(v) if k == "step" else _as_stock(k, v, p, c)) for k, v in new.items()
        }
    return whole


def _zero_group_steps(
    optimizer: torch.optim.Optimizer,
    missing_ids: set[int],
    groups: list[dict],
    before: list[dict],
) -> None:
    """A group-level ``step`` (apex / TE FusedAdam keep it in the group) the scratch step
    created, materialised as 0 in the live groups that had state-less params (and in
    ``before``, so the check after does not count it as a change)."""
    touched = [
        gi
        for gi, g in enumerate(optimizer.param_groups)
        if any(id(p) in missing_ids for p in g["params"])
    ]
    for gi, sg in zip(touched, groups, strict=True):
        live = optimizer.param_groups[gi]
        if "step" in sg and "step" not in live:
            step = sg["step"]
            live["step"] = (
                step.detach().clone().zero_() if isinstance(step, torch.Tensor) else (type(step)(0))
            )
            before[gi]["step"] = live["step"]


def _check_untouched(
    optimizer: torch.optim.Optimizer, versions: list[tuple[torch.Tensor, int]], before: list[dict]
) -> None:
    """Raise when a live param's version counter moved or a hyperparameter changed (a bug)."""
    moved = [p for p, v in versions if p._version != v]
    after = _snapshot(optimizer)
    changed = [
        (gi, k)
        for gi, (b, a) in enumerate(zip(before, after, strict=True))
        for k in set(b) | set(a)
        if not _same(b.get(k), a.get(k))
    ]
    if moved or changed:
        raise RuntimeError(
            f"materialising optimizer state changed {len(moved)} params and hyperparameters "
            f"{changed}; this is a bug in mfsdp_optim.checkpoint, please report it"
        )
