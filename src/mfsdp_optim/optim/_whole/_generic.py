"""Any optimizer's own ``step()`` on whole params: the exact path for classes that read a whole
param (torch's Adafactor) and classes the package does not know.

Members send a unit's owner their pieces of the param, its grad and every param-shaped state
entry; receivers (the ranks of the other replica groups, where the unit spans the replicas:
``_plan.spans_replicas``) send their grad presence only. The owner checks that every member and
receiver agrees on the grad's presence, assembles full tensors and calls ``optimizer.step()``
once, shown (in place, as ``_engines._views.local_shard_view`` does) group lists holding the full
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

from ..._infra.attempt import Attempt
from ..._infra.comm import collective_device
from ..._infra.placement import SCALAR_STATE_KEYS, in_layout_of
from ._checks import partial_grad_message
from ._exchange import WORDING, exchange_records, exchange_records_hosted, view_as
from ._pieces import Piece, extract, insert, piece_numel, piece_shape
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
    rank raises alike (``Attempt.settle``) with no param, state entry or group value changed.
    ``host``: the host-side group of ``group``'s ranks (see the module docstring), or None."""
    _GenericStep(optimizer, params, group_index, plan, group, host).run()


def _nothing(world: int) -> list[tuple[list, list[torch.Tensor]]]:
    """Every peer's record of a rank that sends nothing: an empty header, no tensor."""
    return [([], []) for _ in range(world)]


class _GenericStep:
    """The phases of one ``generic_step`` (see there), on one rank. Each phase runs only while
    no rank is known to have failed (``Attempt.run``); both exchanges run on every rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[DTensor],
        group_index: Sequence[int],
        plan: WholeParamPlan,
        group: dist.ProcessGroup | None,
        host: dist.ProcessGroup | None,
    ):
        self.opt, self.params, self.group_index, self.plan = optimizer, params, group_index, plan
        self.group, self.host = group, host
        self.units, self.rank, self.world = plan.units, plan.rank, plan.world
        self.wire = collective_device(group).type  # where the tensors' bytes travel
        self.attempt = Attempt()
        self.mine = dict(zip(plan.local_units, range(len(params)), strict=True))  # unit -> i
        self.present = {u: params[i].grad is not None for u, i in self.mine.items()}
        # each group's values before the class's step: put back where the step is refused
        self.before = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]

    def run(self) -> None:
        attempt, world = self.attempt, self.world
        records = attempt.run(self.pack_inward, default=_nothing(world))
        got = self.send("generic_in", records)
        pieces_in, member_present = attempt.run(self.read_pieces, got, default=({}, {}))
        fulls, view = attempt.run(self.assemble, pieces_in, member_present, default=({}, {}))
        stepped, level, removed = attempt.run(self.step_owned, fulls, view, default=({}, {}, []))
        out, results = attempt.run(self.pack_outward, fulls, stepped, default=(_nothing(world), {}))
        back = self.send("generic_out", out)
        if not attempt.ok:
            self.restore_group_values()  # what the class's step set there
        attempt.settle(self.host if self.host is not None else self.group, WORDING)
        # every rank succeeded: read the results, then write the params and their state
        results.update(self.read_results(back))
        self.write(results, level, removed)

    def send(
        self, direction: str, records: list[tuple[list, list[torch.Tensor]]]
    ) -> list[tuple[object, torch.Tensor]]:
        """One exchange of records (a sizes all-to-all + one), this rank's status word in it;
        the peers' status words and a packing error (a header that does not pickle) go into
        the attempt."""
        status = self.attempt.status
        if self.host is None:
            got, statuses, packing = exchange_records(direction, records, status, self.group)
        else:
            got, statuses, packing = exchange_records_hosted(
                direction, records, status, self.group, self.host
            )
        if packing is not None:
            self.attempt.fail(packing)
        self.attempt.heard(statuses)
        return got

    # ------------------------------------------------------------------------ members -> owner

    def pack_inward(self) -> list[tuple[list, list[torch.Tensor]]]:
        """Each owner's record from this rank: a ``(unit, present, [(key, dtype)])`` header per
        unit it owns, then the pieces' bytes (a receiver sends its presence only)."""
        optimizer, units, rank = self.opt, self.units, self.rank
        if not isinstance(optimizer.state, MutableMapping):
            raise TypeError(
                f"{type(optimizer).__name__}.state is a {type(optimizer.state).__name__}, not a "
                "mutable mapping: the whole-param step cannot show it the full params' state"
            )
        records = _nothing(self.world)
        for u, i in self.mine.items():
            owner = units[u].owner
            if owner == rank:
                continue
            p = self.params[i]
            entries = []
            if self.present[u]:
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
                            f"param {self.plan.metas[i].name!r}: its state entry {k!r} has the "
                            f"local shard {tuple(t.shape)}, the param "
                            f"{tuple(p._local_tensor.shape)}: the state does not belong to this "
                            "layout (load it again, or reset the state); nothing was updated on "
                            "any rank"
                        )
                if rank in units[u].members:  # a receiver sends its presence only
                    entries = [(PARAM, p._local_tensor), (GRAD, _grad_local(p)), *sharded]
            records[owner][0].append((u, self.present[u], [(k, str(t.dtype)) for k, t in entries]))
            records[owner][1].extend(t for _, t in entries)
        return records

    def read_pieces(
        self, got: list[tuple[object, torch.Tensor]]
    ) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict[tuple[int, int], bool]]:
        """The owner's view of what it received: each ``(unit, member)``'s pieces by key, and
        each ``(unit, member or receiver)``'s grad presence."""
        pieces_in: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        member_present: dict[tuple[int, int], bool] = {}
        for r, (header, raw) in enumerate(got):
            if r == self.rank or header is None:
                continue
            offset = 0
            for u, here, sent_keys in header:  # type: ignore[attr-defined]
                member_present[(u, r)] = here
                piece = self.units[u].piece_for(r)
                n = piece_numel(piece)
                entry = {}
                for k, dt in sent_keys:
                    dtype = _dtype(dt)
                    size = n * torch.empty((), dtype=dtype).element_size()
                    entry[k] = view_as(raw[offset : offset + size], dtype, piece_shape(piece))
                    offset += size
                pieces_in[(u, r)] = entry
        return pieces_in, member_present

    def assemble(
        self,
        pieces_in: dict[tuple[int, int], dict[str, torch.Tensor]],
        member_present: dict[tuple[int, int], bool],
    ) -> tuple[dict[int, torch.Tensor], dict[torch.Tensor, dict]]:
        """The full param (its full grad attached) of every unit this rank owns with a grad,
        after checking that its holders agree on the grad's presence, and the full params'
        state: full tensors for the param-shaped entries, copies of the others."""
        rank, present = self.rank, self.present
        fulls: dict[int, torch.Tensor] = {}
        view: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for u, i in self.mine.items():
            unit = self.units[u]
            if unit.owner != rank:
                continue
            holders = unit.holders
            here = [present[u] if m == rank else member_present[(u, m)] for m in holders]
            if len(set(here)) > 1:
                have = [m for m, h in zip(holders, here, strict=True) if h]
                lack = [m for m, h in zip(holders, here, strict=True) if not h]
                raise ValueError(partial_grad_message(unit.meta.name, have, lack))
            if not present[u]:
                continue
            p = self.params[i]
            device = p._local_tensor.device
            state = self.opt.state.get(p, {})
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
        return fulls, view

    def step_owned(
        self, fulls: dict[int, torch.Tensor], view: dict[torch.Tensor, dict]
    ) -> tuple[dict[torch.Tensor, dict], dict, list]:
        """The class's own ``step()``, once on every rank: owners see their full params, the
        others empty lists (``_step_on``)."""
        groups = self.opt.param_groups
        saved = [list(g["params"]) for g in groups]
        shown: list[list[torch.Tensor]] = [[] for _ in groups]
        for u, full_param in fulls.items():
            shown[self.group_index[self.mine[u]]].append(full_param)
        return _step_on(self.opt, view, shown, saved, self.params)

    # ------------------------------------------------------------------------ owner -> members

    def pack_outward(
        self, fulls: dict[int, torch.Tensor], stepped: dict[torch.Tensor, dict]
    ) -> tuple[list[tuple[list, list[torch.Tensor]]], dict[int, tuple[list, list]]]:
        """Each member's and receiver's record from this owner: per unit, the group's values,
        its piece of the new param and of each param-shaped entry, every other entry whole;
        and this owner's own results (``(keys, tensors)`` per unit)."""
        rank, groups = self.rank, self.opt.param_groups
        out = _nothing(self.world)
        results: dict[int, tuple[list, list]] = {}
        for u, full_param in fulls.items():
            gi = self.group_index[self.mine[u]]
            settings = {k: v for k, v in groups[gi].items() if k != "params"}
            new_state = stepped.get(full_param, {})
            for member, piece in self.units[u].holder_pieces():
                keys, tensors = self._result_of(full_param, new_state, settings, piece)
                if member == rank:
                    results[u] = (keys, tensors)
                else:
                    out[member][0].append((u, keys))
                    out[member][1].extend(t for t in tensors if t is not None)
        return out, results

    def _result_of(
        self, full_param: torch.Tensor, new_state: dict, settings: dict, piece: Piece
    ) -> tuple[list[tuple], list[torch.Tensor | None]]:
        """One holder's result for one unit: the keys (key, kind, dtype, shape, value) and the
        tensors (None where the value travels in the header). Kinds: ``"g"`` the group's
        values, ``"p"`` a piece of a param-shaped tensor, ``"h"`` a host value (a CPU step
        counter) in the header, ``"r"`` a tensor sent whole, ``"v"`` any other value."""
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
                self.host is not None
                and isinstance(v, torch.Tensor)
                and (v.device.type != self.wire and v.device.type == "cpu")
            ):  # a host value (a CPU step counter): in the header, never on the device
                keys.append((k, "h", None, None, v))
                tensors.append(None)
            elif isinstance(v, torch.Tensor) and str(v.dtype) in _DTYPES:
                keys.append((k, "r", str(v.dtype), tuple(v.shape), v.device.type))
                tensors.append(v)
            else:
                keys.append((k, "v", None, None, v))
                tensors.append(None)
        return keys, tensors

    def restore_group_values(self) -> None:
        """Each group's values as before the class's step (a refused step changes none)."""
        for g, before in zip(self.opt.param_groups, self.before, strict=True):
            for k in [k for k in g if k != "params" and k not in before]:
                del g[k]
            g.update(before)

    # ---------------------------------------------------- after the exchanges: every rank is ok

    def read_results(self, back: list[tuple[object, torch.Tensor]]) -> dict[int, tuple]:
        """Each unit's ``(keys, tensors)`` from the records its owner sent this rank."""
        results: dict[int, tuple] = {}
        for r, (header, raw) in enumerate(back):
            if r == self.rank or header is None:
                continue
            offset = 0
            for u, got_keys in header:  # type: ignore[attr-defined]
                piece = self.units[u].piece_for(self.rank)
                tensors: list[torch.Tensor | None] = []
                for _, kind, dt, shape, _ in got_keys:
                    if kind in ("v", "g", "h"):
                        tensors.append(None)
                        continue
                    dtype = _dtype(dt)
                    shp = piece_shape(piece) if kind == "p" else shape
                    size = (
                        int(torch.Size(shp).numel()) * torch.empty((), dtype=dtype).element_size()
                    )
                    tensors.append(view_as(raw[offset : offset + size], dtype, shp))
                    offset += size
                results[u] = (got_keys, tensors)
        return results

    def write(self, results: dict[int, tuple], level: dict, removed: list) -> None:
        """The optimizer-level entries the step changed, then each unit's param, state and
        group values."""
        state = self.opt.state
        for k in removed:  # optimizer-level entries the step removed
            del state[k]
        state.update(level)
        groups = self.opt.param_groups
        for u, (keys, tensors) in results.items():
            i = self.mine[u]
            _apply(self.opt, self.params[i], keys, tensors)
            _apply_settings(groups[self.group_index[i]], keys[0][4])


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
