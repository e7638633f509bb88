"""Rank-side helpers for the checkpoint tests (a helper module: pytest collects nothing here).

A small model of five params is built by hand as DTensors in one of three layouts, trained a few
steps with deterministic global grads, and compared against a plain, unsharded reference
optimizer that every rank runs on the full tensors.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _layouts import GradSpec, PlacementSpec, build_grad, global_tensor

from mfsdp_optim._infra.params import ParamRecord

# the checked-in checkpoints (tests/data/, see _v010.py, _format2.py, _format3.py)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

S0, S1, R = PlacementSpec("S", 0), PlacementSpec("S", 1), PlacementSpec("R")
SS0 = PlacementSpec("SS", 0, 2)

# name, global shape; on 4-rank FSDP "tiny" is empty on ranks 2,3 and "layers.1.bias" on rank 3
PARAMS = [
    ("layers.0.weight", (10, 8)),
    ("layers.0.bias", (10,)),
    ("layers.1.weight", (8, 10)),
    ("tiny", (2, 3)),
    ("layers.1.bias", (3,)),
]
WEIGHTS = {"layers.0.weight", "layers.1.weight"}

TP_FSDP = {  # (dp, tp) mesh: FSDP over TP as torchtitan lays it out
    "layers.0.weight": (S0, S1),
    "layers.0.bias": (S0, R),
    "layers.1.weight": (SS0, S0),
    "tiny": (S1, S0),
    "layers.1.bias": (R, R),
}

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    "adam_tensor_lr": (torch.optim.Adam, {"lr": torch.tensor(0.01), "betas": (0.8, 0.9)}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_amsgrad": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    "adagrad": (
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1},
    ),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "adamax": (torch.optim.Adamax, {"lr": 0.01}),
    "nadam": (torch.optim.NAdam, {"lr": 0.01}),
    "radam": (torch.optim.RAdam, {"lr": 0.01}),
}


def world() -> int:
    return dist.get_world_size()


def mesh_shape(layout: str) -> tuple[int, ...]:
    return (world(),) if layout == "fsdp" else (2, world() // 2)


def spec(layout: str, index: int, seed: int) -> GradSpec:
    name, shape = PARAMS[index]
    if layout == "fsdp":
        return GradSpec(shape, (world(),), (0,), (S0,), seed=seed)
    if layout == "hsdp":
        return GradSpec(shape, (2, world() // 2), (0, 1), (R, S0), seed=seed)
    assert layout == "tp_fsdp", layout
    return GradSpec(shape, (2, world() // 2), (0, 1), TP_FSDP[name], seed=seed)


class Model:
    """DTensor params, the base optimizer and the records the wrapper would pass."""

    def __init__(self, layout, opt_name, *, alias=True, filter_empty=True, lr_scale=1.0):
        self.layout = layout
        self.alias = alias
        self.params = [
            torch.nn.Parameter(
                build_grad(spec(layout, i, 1000 + i), check=False), requires_grad=False
            )
            for i in range(len(PARAMS))
        ]
        self.records = []
        for (name, _), p in zip(PARAMS, self.params, strict=True):
            opt_param = p._local_tensor if alias else p
            if filter_empty and p._local_tensor.numel() == 0:
                opt_param = None
            self.records.append(ParamRecord(name, p, opt_param))
        cls, kw = OPTIMIZERS[opt_name]
        kw = dict(kw)
        kw["lr"] = kw["lr"] * lr_scale
        self.optimizer = cls(self._groups(kw), **kw)

    def _groups(self, kw):
        g0 = [r.opt_param for r in self.records if r.fqn in WEIGHTS and r.opt_param is not None]
        g1 = [r.opt_param for r in self.records if r.fqn not in WEIGHTS and r.opt_param is not None]
        lr1 = kw["lr"] * 0.5
        return [{"params": g0}, {"params": g1, "lr": lr1}]

    def step(self, t: int, skip=()):
        for i, rec in enumerate(self.records):
            if rec.opt_param is None:
                continue
            if rec.fqn in skip:
                rec.opt_param.grad = None
                continue
            g = build_grad(spec(self.layout, i, 7 * t + i + 1), check=False)
            rec.opt_param.grad = g._local_tensor if self.alias else g
        self.optimizer.step()


def reference(opt_name, steps, skip=()):
    """The same training on full plain tensors in one process: {fqn: {key: tensor|float}}."""
    full = {
        name: global_tensor(GradSpec(shape, (1,), (0,), (S0,), seed=1000 + i), ()).clone()
        for i, (name, shape) in enumerate(PARAMS)
    }
    cls, kw = OPTIMIZERS[opt_name]
    kw = dict(kw)
    groups = [
        {"params": [full[n] for n, _ in PARAMS if n in WEIGHTS]},
        {"params": [full[n] for n, _ in PARAMS if n not in WEIGHTS], "lr": kw["lr"] * 0.5},
    ]
    opt = cls(groups, **kw)
    for t in range(steps):
        for i, (name, shape) in enumerate(PARAMS):
            if name in skip:
                full[name].grad = None
                continue
            full[name].grad = global_tensor(
                GradSpec(shape, (1,), (0,), (S0,), seed=7 * t + i + 1), ()
            )
        opt.step()
    return {
        n: {k: plain(v) for k, v in opt.state[full[n]].items()}
        for n, _ in PARAMS
        if full[n] in opt.state
    }, {n: p.clone() for n, p in full.items()}


def plain(v):
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.full_tensor().clone()
    if isinstance(v, torch.Tensor):
        return v.clone() if v.dim() else float(v.item())
    return v


def global_state(sd):
    """{fqn: {key: full tensor | float}} and the hyperparameters; collective on every rank.

    Any layout: a format-3 table must be identical on every rank (checked with one object
    gather); a format-2 dict's leaves (hyperparameters + ``step``), which only the ranks whose
    optimizer holds a param emit, are first shared with every rank (one object gather), so
    every rank returns the same global view."""
    from mfsdp_optim.checkpoint._state_dict._load_sharded_state_dict import as_format1
    from mfsdp_optim.checkpoint._state_dict._table import as_table, is_table

    leaves = sd["param_to_group_meta"]
    if is_table(leaves):
        table = as_table(leaves)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, table.as_tuple())
        assert all(t == everyone[0] for t in everyone), "ranks emit different tables"
        sd = as_format1({"state": sd["state"], "param_to_group_meta": table})
    elif not any(isinstance(v, dict) for v in leaves.values()):  # format 2, even when empty
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, leaves)
        union = {}
        for got in everyone:
            for fqn, leaf in got.items():
                assert union.setdefault(fqn, leaf) == leaf, f"ranks emit different {fqn!r} leaves"
        sd = as_format1({"state": sd["state"], "param_to_group_meta": union})
    state = {
        fqn: {k: plain(sd["state"][fqn][k]) for k in sorted(sd["state"][fqn])}
        for fqn in sorted(sd["state"])
    }
    meta = {
        fqn: {k: plain(v) for k, v in m.items()} for fqn, m in sd["param_to_group_meta"].items()
    }
    return state, meta


def global_params(model):
    return {r.fqn: r.param.full_tensor().clone() for r in model.records}


def snapshot(model):
    """A deep copy of the live optimizer's state and hyperparameters, to compare before/after."""
    state = {}
    for r in model.records:
        if r.opt_param is not None and r.opt_param in model.optimizer.state:
            state[r.fqn] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in model.optimizer.state[r.opt_param].items()
            }
    groups = [
        {
            k: (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in g.items()
            if k != "params"
        }
        for g in model.optimizer.param_groups
    ]
    return state, groups


def same(a, b) -> bool:
    """Exact equality of nested dicts/lists of tensors and plain values (bitwise for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        from torch.distributed.tensor import DTensor

        if isinstance(a, DTensor):
            a = a._local_tensor
        if isinstance(b, DTensor):
            b = b._local_tensor
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------------------------------
# SIGKILL tests: a separately spawned group of ranks (the pools can't lose a rank)

KILL_PG_TIMEOUT_S = 6.0  # the spawned group's; survivors must give up within it (plus slack)


def start_kill_rank(rank: int, world: int, init_file: str, root: str) -> tuple[Model, dict]:
    """A spawned rank's common start: join the group (timeout ``KILL_PG_TIMEOUT_S``), train one
    step of the Adam model, save it to ``root/step_1`` (rank 0 also keeps its global state in
    ``state_1.pt``), take one more step; the model and its state dict, to be saved next."""
    import warnings

    from _ranks import join_gloo_group

    from mfsdp_optim.checkpoint import build_sharded_state_dict, save_checkpoint

    warnings.simplefilter("ignore")
    join_gloo_group(rank, world, init_file, KILL_PG_TIMEOUT_S)
    m = Model("fsdp", "adam")
    m.step(0)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    state = global_state(sd)
    save_checkpoint({"optimizer": sd}, os.path.join(root, "step_1"))
    if rank == 0:
        torch.save(state, os.path.join(root, "state_1.pt"))
    m.step(1)
    return m, build_sharded_state_dict(m.optimizer, m.records)


def end_kill_rank(root: str, rank: int, outcome: dict) -> None:
    """A surviving rank's end: its outcome into ``root/outcome<rank>.json``, then exit at once
    (a process group with a dead peer cannot be torn down cleanly)."""
    import json

    with open(os.path.join(root, f"outcome{rank}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def spawn_ranks(target, root: str, extra: tuple, world: int = 2, limit_s: float = 120.0):
    """``target(rank, world, init_file, root, *extra)`` on ``world`` forkserver processes; a
    rank that creates ``root/kill_all`` has every rank SIGKILLed. Returns the exit codes and
    the ranks still alive after ``limit_s`` (killed then: a hang)."""
    import contextlib
    import signal
    import time

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("forkserver")
    init_file = os.path.join(root, "init")
    procs = [
        ctx.Process(target=target, args=(r, world, init_file, root, *extra)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if os.path.exists(os.path.join(root, "kill_all")):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):  # it may have died meanwhile
                    os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.01)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():  # a hung rank: a failure, but clean up first
            p.kill()
        p.join()
    return [p.exitcode for p in procs], hung
