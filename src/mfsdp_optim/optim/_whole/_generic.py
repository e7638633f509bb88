"""Any optimizer's own ``step()`` on whole params: the exact path for classes that read a whole
param (torch's Adafactor) and classes the package does not know.

Members send a unit's owner their pieces of the param, its grad and every param-shaped state
entry; receivers (the ranks of the other replica groups, where the unit spans the replicas:
``_plan.spans_replicas``) send their grad presence only. The owner checks that every member and
receiver agrees on the grad's presence, assembles full tensors and calls ``optimizer.step()``
once, shown (in place, as ``optim._views.local_shard_view`` does) group lists holding the full
params it owns and a state mapping keyed by them; every other rank calls ``step()`` once with
its lists emptied (step hooks run once per rank). The owner sends back each member's and each
receiver's piece of the new param and of each param-shaped entry, every other entry whole (a
Replicate DTensor on the param's mesh; 0-d and plain values as stock keeps them) and the values
the class wrote into the param's group; each direction: a sizes all-to-all + one. A receiver
ends with what a member of its replica group gets (the replicas' state is the same, so the
owner's step is the one their own owner would have run). Optimizer-level state (entries not
keyed by a param, such as MADGRAD's ``k``) steps on every rank alike. Nothing is written before
every rank knows every rank succeeded.

With a host-side group (``host``: ``OptimizerConfig(host_sync=False)``), the headers, status
words and state values that live on the host (a CPU step counter such as Adafactor's ``step``,
kind ``"h"``) travel through it and only the tensors' bytes through the device group, so the
package reads nothing back from the device (the class's own ``step()`` reads what it reads:
torch's Adafactor reads two norms per param on the host, on the owner).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..._infra.comm import collective_device
from ..._infra.placement import SCALAR_STATE_KEYS, in_layout_of
from ._checks import partial_grad_message
from ._exchange import exchange_records, exchange_records_hosted, settle, view_as
from ._pieces import extract, insert, piece_numel, piece_shape
from ._plan import WholeParamPlan

__all__ = ["generic_step"]

PARAM = "__param__"
GROUP = "__group__"
GRAD = "__grad__"
_DTYPES = {
    str(t): t
    for t in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
        torch.int8,
    )
}


def _dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _param_shaped(key: str, value: object, shape: tuple[int, ...]) -> bool:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        return False
    return len(shape) > 0 or key not in SCALAR_STATE_KEYS


def _sharded_like(key: str, value: object, p: DTensor) -> bool:
    """A DTensor entry laid out as the param (its local tensor is the param's piece)."""
    return (
        isinstance(value, DTensor)
        and _param_shaped(key, value, tuple(p.shape))
        and value.device_mesh == p.device_mesh
        and tuple(value.placements) == tuple(p.placements)
    )


def _grad_local(p: DTensor) -> torch.Tensor:
    grad = p.grad
    assert isinstance(grad, DTensor)  # checked by step_whole_params before any exchange
    return grad._local_tensor


def _local(value: object) -> object:
    return value._local_tensor if isinstance(value, DTensor) else value


def _snapshot(value: object) -> object:
    """A state value the class may change in place, as a copy (its step runs on copies)."""
    value = _local(value)
    return value.clone() if isinstance(value, torch.Tensor) else value


def generic_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[DTensor],
    group_index: Sequence[int],
    plan: WholeParamPlan,
    group: dist.ProcessGroup | None,
    host: dist.ProcessGroup | None = None,
) -> None:
    """One step of the class's own ``step()`` on whole params, after the step's agreement.

    The owner steps full copies (param, grad, every state entry), so nothing the class changes
    is live until every rank knows every rank succeeded; an exception anywhere (the class's own
    ``step()`` included) is the rank's status in the next exchange, and after the last one every
    rank raises alike (``settle``) with no param, state entry or group value changed.
    ``host``: the host-side group of ``group``'s ranks (see the module docstring), or None."""
    units, rank, world = plan.units, plan.rank, plan.world
    wire = collective_device(group).type  # where the tensors' bytes travel

    def send(direction, records, status):
        if host is None:
            return exchange_records(direction, records, status, group)
        return exchange_records_hosted(direction, records, status, group, host)

    error: BaseException | None = None
    mine = dict(zip(plan.local_units, range(len(params)), strict=True))  # unit -> param index
    present = {u: params[i].grad is not None for u, i in mine.items()}
    # members -> owner: (unit, present, [(key, dtype)]) headers, then the pieces' bytes
    records: list[tuple[list, list[torch.Tensor]]] = [([], []) for _ in range(world)]
    try:
        if not isinstance(optimizer.state, MutableMapping):
            raise TypeError(
                f"{type(optimizer).__name__}.state is a {type(optimizer.state).__name__}, not a "
                "mutable mapping: the whole-param step cannot show it the full params' state"
            )
        for u, i in mine.items():
            owner = units[u].owner
            if owner == rank:
                continue
            p = params[i]
            entries = []
            if present[u]:
                # members and receivers alike read their state now, before any byte moves (the
                # results are written into it after the last exchange, where nothing may fail)
                sharded = [
                    (k, v._local_tensor)
                    for k, v in optimizer.state.get(p, {}).items()
                    if _sharded_like(k, v, p)
                ]
                for k, t in sharded:
                    if t.shape != p._local_tensor.shape:
                        raise ValueError(
                            f"param {plan.metas[i].name!r}: its state entry {k!r} has the local "
                            f"shard {tuple(t.shape)}, the param {tuple(p._local_tensor.shape)}: "
                            "the state does not belong to this layout (load it again, or reset "
                            "the state); nothing was updated on any rank"
                        )
                if rank in units[u].members:  # a receiver sends its presence only
                    entries = [(PARAM, p._local_tensor), (GRAD, _grad_local(p)), *sharded]
            records[owner][0].append((u, present[u], [(k, str(t.dtype)) for k, t in entries]))
            records[owner][1].extend(t for _, t in entries)
    except Exception as exc:  # still takes part in both exchanges, then raises (settle)
        error = exc
        records = [([], []) for _ in range(world)]
    got, statuses, packing = send(
        "generic_in", [(h, t) for h, t in records], int(error is not None)
    )
    error = error or packing
    ok = error is None and not any(statuses)
    # owners: every member's and receiver's presence, then full tensors of the units they own
    pieces_in: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    member_present: dict[tuple[int, int], bool] = {}  # (unit, member or receiver) -> grad
    try:
        for r, (header, raw) in enumerate(got):
            if r == rank or header is None or not ok:
                continue
            offset = 0
            for u, here, sent_keys in header:  # type: ignore[attr-defined]
                member_present[(u, r)] = here
                piece = units[u].piece_for(r)
                n = piece_numel(piece)
                entry = {}
                for k, dt in sent_keys:
                    dtype = _dtype(dt)
                    size = n * torch.empty((), dtype=dtype).element_size()
                    entry[k] = view_as(raw[offset : offset + size], dtype, piece_shape(piece))
                    offset += size
                pieces_in[(u, r)] = entry
    except Exception as exc:
        error, ok = exc, False
    fulls: dict[int, torch.Tensor] = {}
    view: defaultdict[torch.Tensor, dict] = defaultdict(dict)
    try:
        for u, i in mine.items():
            unit = units[u]
            if unit.owner != rank or not ok:
                continue
            holders = unit.holders
            here = [present[u] if m == rank else member_present[(u, m)] for m in holders]
            if len(set(here)) > 1:
                have = [m for m, h in zip(holders, here, strict=True) if h]
                lack = [m for m, h in zip(holders, here, strict=True) if not h]
                raise ValueError(partial_grad_message(unit.meta.name, have, lack))
            if not present[u]:
                continue
            p = params[i]
            device = p._local_tensor.device
            state = optimizer.state.get(p, {})
            own = {PARAM: p._local_tensor, GRAD: _grad_local(p)}
            own.update({k: _local(v) for k, v in state.items() if _sharded_like(k, v, p)})
            full = {k: torch.empty(p.shape, dtype=t.dtype, device=device) for k, t in own.items()}
            for member, piece in zip(unit.members, unit.pieces, strict=True):
                src = own if member == rank else pieces_in[(u, member)]
                for k, t in full.items():
                    insert(t, piece, src[k].to(device))
            full_param = full.pop(PARAM)
            full_param.grad = full.pop(GRAD)
            fulls[u] = full_param
            view[full_param] = {k: full.get(k, _snapshot(v)) for k, v in state.items()}
    except Exception as exc:
        error, ok = exc, False
    # every rank steps once; owners see their full params, the others empty lists
    groups = optimizer.param_groups
    saved = [list(g["params"]) for g in groups]
    values = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    shown: list[list[torch.Tensor]] = [[] for _ in groups]
    for u, full_param in fulls.items():
        shown[group_index[mine[u]]].append(full_param)
    stepped: dict[torch.Tensor, dict] = {}
    level: dict = {}
    removed: list = []
    if ok:
        try:
            stepped, level, removed = _step_on(optimizer, view, shown, saved, params)
        except Exception as exc:  # the class's own step: reported like any other failure
            error, ok = exc, False
    # owner -> members and receivers: the param's piece, param-shaped pieces, full other entries
    out: list[tuple[list, list[torch.Tensor]]] = [([], []) for _ in range(world)]
    results: dict[int, tuple[list, list]] = {}
    try:
        for u, full_param in fulls.items() if ok else ():
            unit = units[u]
            new_state = stepped.get(full_param, {})
            gi = group_index[mine[u]]
            settings = {k: v for k, v in groups[gi].items() if k != "params"}
            for member, piece in unit.holder_pieces():
                keys: list[tuple] = [
                    (GROUP, "g", None, None, settings),
                    (PARAM, "p", str(full_param.dtype), None, None),
                ]
                tensors: list[torch.Tensor | None] = [None, extract(full_param, piece)]
                for k, v in new_state.items():
                    if _param_shaped(k, v, tuple(full_param.shape)):
                        keys.append((k, "p", str(v.dtype), None, None))
                        tensors.append(extract(v, piece))
                    elif (
                        host is not None
                        and isinstance(v, torch.Tensor)
                        and (v.device.type != wire and v.device.type == "cpu")
                    ):  # a host value (a CPU step counter): in the header, never on the device
                        keys.append((k, "h", None, None, v))
                        tensors.append(None)
                    elif isinstance(v, torch.Tensor) and str(v.dtype) in _DTYPES:
                        keys.append((k, "r", str(v.dtype), tuple(v.shape), v.device.type))
                        tensors.append(v)
                    else:
                        keys.append((k, "v", None, None, v))
                        tensors.append(None)
                if member == rank:
                    results[u] = (keys, tensors)
                else:
                    out[member][0].append((u, keys))
                    out[member][1].extend(t for t in tensors if t is not None)
    except Exception as exc:
        error, ok = exc, False
    if not ok:
        out = [([], []) for _ in range(world)]
    back, statuses_out, packing = send("generic_out", out, int(error is not None))
    error = error or packing  # e.g. a group or state value that does not pickle
    if error is not None or any(statuses_out) or any(statuses):
        for g, before in zip(groups, values, strict=True):  # what the class's step set there
            for k in [k for k in g if k != "params" and k not in before]:
                del g[k]
            g.update(before)
    settle(error, [*statuses, *statuses_out], host if host is not None else group)
    # every rank succeeded: read the results, then write the params and their state
    for r, (header, raw) in enumerate(back):
        if r == rank or header is None:
            continue
        offset = 0
        for u, got_keys in header:  # type: ignore[attr-defined]
            piece = units[u].piece_for(rank)
            tensors = []
            for _, kind, dt, shape, _ in got_keys:
                if kind in ("v", "g", "h"):
                    tensors.append(None)
                    continue
                dtype = _dtype(dt)
                shp = piece_shape(piece) if kind == "p" else shape
                size = int(torch.Size(shp).numel()) * torch.empty((), dtype=dtype).element_size()
                tensors.append(view_as(raw[offset : offset + size], dtype, shp))
                offset += size
            results[u] = (got_keys, tensors)
    state = optimizer.state
    for k in removed:  # optimizer-level entries the step removed
        del state[k]
    state.update(level)
    for u, (keys, tensors) in results.items():
        _apply(optimizer, params[mine[u]], keys, tensors)
        _apply_settings(groups[group_index[mine[u]]], keys[0][4])


def _step_on(
    optimizer: torch.optim.Optimizer,
    view: dict[torch.Tensor, dict],
    shown: list[list[torch.Tensor]],
    saved: list[list[torch.Tensor]],
    params: Sequence[DTensor],
) -> tuple[dict[torch.Tensor, dict], dict, list]:
    """``optimizer.step()`` with the group lists set to ``shown`` and the state mapping holding
    ``view`` (the full params' state) beside the optimizer's own entries that are not keyed by
    a wrapped param (e.g. a step counter ``state["k"]``), all restored in place afterwards (the
    mapping is never reassigned: some classes expose ``state`` as a read-only property).
    Returns each full param's state after the step, the optimizer-level entries after it and
    the optimizer-level keys it removed (every rank steps once, so they agree), which the caller
    writes once every rank succeeded; the step runs on copies of the optimizer-level entries."""
    groups = optimizer.param_groups
    state = optimizer.state
    wrapped = {id(p) for p in params} | {id(p) for lst in saved for p in lst}
    original = dict(state)
    extra = {k: _snapshot(v) for k, v in original.items() if id(k) not in wrapped}
    eps = _stock_eps1(optimizer, saved)
    try:
        for g, lst in zip(groups, shown, strict=True):
            g["params"][:] = lst
        for gi, value in eps.items():
            groups[gi]["eps"] = value[1]
        state.clear()
        state.update(view)
        state.update(extra)
        optimizer.step()
        after = dict(state)
    finally:
        for gi, value in eps.items():
            groups[gi]["eps"] = value[0]
        for g, lst in zip(groups, saved, strict=True):
            g["params"][:] = lst
        state.clear()
        state.update(original)
    full_ids = {id(p) for p in view}
    level = {k: v for k, v in after.items() if id(k) not in full_ids}
    removed = [k for k in extra if k not in after]
    return {p: after.get(p, {}) for p in view}, level, removed


def _stock_eps1(optimizer: torch.optim.Optimizer, saved: list[list[torch.Tensor]]) -> dict:
    """torch's Adafactor with ``eps=(None, eps2)`` takes eps1 from one dtype for the whole
    group (``_eps1_dtype``); an owner sees only its own params, so each such group gets that
    value for the call: ``{group index: (the group's eps, the eps to step with)}``."""
    adafactor = getattr(torch.optim, "Adafactor", None)
    if adafactor is None or not isinstance(optimizer, adafactor):
        return {}
    out = {}
    for gi, (g, lst) in enumerate(zip(optimizer.param_groups, saved, strict=True)):
        eps = g.get("eps")
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2 and eps[0] is None):
            continue
        dtype = _eps1_dtype([p for p in lst if p.grad is not None], bool(g.get("foreach")))
        if dtype is not None:
            pair = (torch.finfo(dtype).eps, eps[1])
            out[gi] = (eps, pair if isinstance(eps, tuple) else list(pair))
    return out


def _eps1_dtype(with_grad: list[torch.Tensor], foreach: bool) -> torch.dtype | None:
    """The dtype whose eps torch's Adafactor takes as eps1 for a group whose params with a grad
    are ``with_grad`` (None: none has a grad). The for-loop step takes the first param's; the
    foreach step the first (device, dtype) bucket's, in the order of torch's own grouping
    (its C++ map's, not the params'), so that grouping is asked, on the local tensors, which
    have the params' dtypes and this rank's device."""
    if not with_grad:
        return None
    if not foreach:
        return with_grad[0].dtype
    local: list[torch.Tensor | None] = [
        p._local_tensor if isinstance(p, DTensor) else p for p in with_grad
    ]
    buckets = torch.optim.Optimizer._group_tensors_by_device_and_dtype([local])
    _, dtype = next(iter(buckets))
    return dtype if dtype is not None else with_grad[0].dtype


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    try:
        return bool(a == b) or a is b
    except Exception:  # noqa: BLE001 - values without a plain == (e.g. arrays)
        return a is b


def _apply_settings(group: dict, settings: dict) -> None:
    """The owner's group values after its step (what the class wrote into its group, e.g. a
    step counter), on a member; a tensor value is updated in place."""
    for k, v in settings.items():
        cur = group.get(k)
        if _same_value(cur, v):
            continue
        if (
            isinstance(cur, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and cur.shape == v.shape
            and cur.dtype == v.dtype
        ):
            cur.copy_(v)
        else:
            group[k] = v


def _apply(optimizer, p: DTensor, keys: list[tuple], tensors: list) -> None:
    local = p._local_tensor
    old = optimizer.state.get(p, {})
    new: dict = {}
    for (k, kind, _, _, value), t in zip(keys, tensors, strict=True):
        if k == PARAM:
            local.copy_(t.to(local.device).view(local.shape))
            continue
        if kind == "g":
            continue
        if kind == "v":
            new[k] = value
            continue
        prev = old.get(k)
        if kind == "h":  # a host tensor from the header (or this owner's own result)
            t = value
            new[k] = _into_plain(prev, t)
            continue
        if kind == "p":
            t = t.to(local.device).view(local.shape)
            kept = _into_local(prev, t, p.shape)
            new[k] = kept if kept is not None else in_layout_of(t.clone(), p)
            continue
        device = local.device if value != "cpu" else torch.device("cpu")
        t = t.to(device)
        if t.dim() == 0:
            new[k] = _into_plain(prev, t)
            continue
        kept = _into_local(prev, t, t.shape)  # a replicated entry holds it whole
        if kept is None:
            mesh = p.device_mesh
            kept = DTensor.from_local(t.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        new[k] = kept
    optimizer.state[p] = new


def _into_plain(prev: Any, t: torch.Tensor) -> torch.Tensor:
    """``t`` written into ``prev`` where it is a plain tensor of the same shape, dtype and
    device (the state entry keeps its identity), else a copy of ``t``."""
    if (
        isinstance(prev, torch.Tensor)
        and not isinstance(prev, DTensor)
        and (prev.shape == t.shape and prev.dtype == t.dtype and prev.device == t.device)
    ):
        prev.copy_(t)
        return prev
    return t.clone()


def _into_local(prev: Any, t: torch.Tensor, shape: torch.Size) -> DTensor | None:
    """``t`` written into the local tensor of ``prev`` where it is a DTensor of global ``shape``
    whose local tensor has ``t``'s shape and dtype (it keeps its identity), else None."""
    if (
        isinstance(prev, DTensor)
        and prev.shape == shape
        and prev.dtype == t.dtype
        and prev._local_tensor.shape == t.shape
    ):
        prev._local_tensor.copy_(t)
        return prev
    return None
