"""The walk of ``build_sharded_state_dict``: each stage module entered once, in order, for good.

A profiler hook records, after every Python call and return, the module of ``mfsdp_optim`` that
is executing. The walk is that sequence with the leaves (modules that are neither the
orchestrator nor a stage: ``_values``, ``_infra.*``) folded into the module that called them;
it must read ``_build > _materialize > _build > _keyspace > _build > _table > _build > _layout >
_build`` (``_build``: ``_build_sharded_state_dict``; ``_materialize``:
``_materialize_optimizer_state``): no return to a module already left except to the orchestrator,
and no leaf calling back into a stage. Traced on 1 rank and on 2 real gloo ranks whose digests
are equal (no merge) and differ (the empty-shard filter: a merge), saving and loading, with
the collectives counted beside it (ONE ``all_reduce``; the gather only when digests differ).
The digest, hashed before any table exists, is checked to decide as the fingerprint of the
table each rank would emit did (the reference, computed independently).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from _collectives import GATHER, counted

from mfsdp_optim.checkpoint import build_sharded_state_dict

pytestmark = pytest.mark.timeout(120)

PACKAGE = "mfsdp_optim."
ORCHESTRATOR = "mfsdp_optim.checkpoint._state_dict._build_sharded_state_dict"
STAGES = tuple(
    f"mfsdp_optim.checkpoint._state_dict.{m}"
    for m in ("_materialize_optimizer_state", "_keyspace", "_table", "_layout")
)


def trace(fn) -> tuple[object, list[str]]:
    """``fn()``'s result and the modules of the package that executed, in order: after each
    call event the callee's, after each return (or yield) the caller's; repeats merged."""
    seq: list[str] = []

    def where(frame) -> str:
        return frame.f_globals.get("__name__", "") if frame is not None else ""

    def hook(frame, event, arg):
        if event == "call":
            mod = where(frame)
        elif event == "return":
            mod = where(frame.f_back)
        else:
            return
        if mod.startswith(PACKAGE) and (not seq or seq[-1] != mod):
            seq.append(mod)

    sys.setprofile(hook)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, seq


def _short(mods) -> str:
    return " > ".join(m.rsplit(".", 1)[-1] for m in mods)


def walk_problems(seq: list[str]) -> list[str]:
    """What is wrong with the traced ``seq``; ``[]`` for the one-direction walk."""
    walk: list[str] = []  # stages and orchestrator, leaves folded into their caller
    problems: list[str] = []
    i = 0
    while i < len(seq):
        mod = seq[i]
        if mod == ORCHESTRATOR or mod in STAGES:
            if not walk or walk[-1] != mod:
                walk.append(mod)
            i += 1
            continue
        j = i
        while j < len(seq) and not (seq[j] == ORCHESTRATOR or seq[j] in STAGES):
            j += 1
        before = seq[i - 1] if i else None
        after = seq[j] if j < len(seq) else None
        if before != after:
            problems.append(
                f"the leaves {_short(seq[i:j])} were entered from {before} and left to {after}"
            )
        i = j
    left: set[str] = set()
    returns = []
    for prev, mod in zip(walk, walk[1:], strict=False):
        left.add(prev)
        if mod in left and mod != ORCHESTRATOR:
            returns.append(mod)
    stages = [m for m in walk if m != ORCHESTRATOR]
    if returns:
        problems.append(f"{len(returns)} returns to a module already left: {_short(returns)}")
    if stages != list(STAGES):
        problems.append(f"stages entered {_short(stages)}, expected {_short(STAGES)} once each")
    if not walk or walk[0] != ORCHESTRATOR or walk[-1] != ORCHESTRATOR:
        problems.append("the walk does not begin and end in the orchestrator")
    if problems:
        problems.append(
            f"walk ({len(walk)} stays): {_short(walk)}; traced ({len(seq)} stays in "
            f"{len(set(seq))} modules): {_short(seq)}"
        )
    return problems


def _setup(rows_tiny: int, stepped: bool):
    """Three params on a 1-d mesh over every rank: two (8, 4) in two param groups, one of the
    optimizer's own DTensors and one local-shard alias, and ``tiny`` of ``rows_tiny`` rows,
    whose empty local shard (on 2 ranks with one row) its optimizer does not hold."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp_optim._infra.params import ParamRecord

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    shapes = {"a": (8, 4), "b": (8, 4), "tiny": (rows_tiny, 4)}
    params = {
        n: torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Shard(0)]))
        for n, s in shapes.items()
    }
    records = [
        ParamRecord("a", params["a"], params["a"]),
        ParamRecord("b", params["b"], params["b"]._local_tensor),
    ]
    tiny = params["tiny"]
    held = tiny._local_tensor.numel() > 0
    records.append(ParamRecord("tiny", tiny, tiny if held else None))
    groups = [{"params": [records[0].opt_param]}, {"params": [records[1].opt_param], "lr": 0.01}]
    if held:
        groups[1]["params"].append(tiny)
    opt = torch.optim.AdamW(groups, lr=0.1)
    if stepped:
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
    return opt, records


def _walk(rows_tiny: int, is_loading: bool, stepped: bool):
    opt, records = _setup(rows_tiny, stepped)
    with counted() as calls:
        sd, seq = trace(lambda: build_sharded_state_dict(opt, records, is_loading=is_loading))
    return seq, dict(calls), sorted(sd["state"]), list(sd["param_to_group_meta"])


@pytest.mark.parametrize(("is_loading", "stepped"), [(False, True), (True, True), (True, False)])
def test_build_walks_each_stage_once_in_order_on_one_rank(ranks, is_loading, stepped):
    [(seq, calls, state, table)] = ranks(1).run(_walk, 8, is_loading, stepped)
    assert walk_problems(seq) == [], "\n".join(walk_problems(seq))
    assert calls == {"all_reduce": 1}, calls
    if stepped or is_loading:
        assert state == ["a", "b", "tiny"] and table == ["a", "b", "tiny"], (state, table)


@pytest.mark.parametrize("is_loading", [False, True])
@pytest.mark.parametrize(("rows_tiny", "merged"), [(8, False), (1, True)])
def test_build_walks_each_stage_once_in_order_on_two_ranks(ranks, is_loading, rows_tiny, merged):
    out = ranks(2).run(_walk, rows_tiny, is_loading, True)
    for rank, (seq, calls, state, table) in enumerate(out):
        problems = walk_problems(seq)
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems)
        # ONE all-reduce of the digest; only when the digests differ (a merge), the object
        # gather: two all-gathers (sizes, payload)
        want = {"all_reduce": 1, GATHER: 2} if merged else {"all_reduce": 1}
        assert calls == want, (rank, calls)
        assert state == ["a", "b", "tiny"] and table == ["a", "b", "tiny"], (rank, state, table)


def test_the_walk_check_sees_a_back_and_forth():
    """The checker itself: a stage entered twice, a stage called from another, a leaf calling
    back into a stage, each is named, with the walk counted."""
    b, m, k, t, lay = (ORCHESTRATOR, *STAGES)
    values = "mfsdp_optim.checkpoint._state_dict._values"
    assert walk_problems([b, m, b, k, values, k, b, t, b, lay, b]) == []
    twice = walk_problems([b, m, b, k, b, t, b, k, b, t, b, lay, b])
    assert "2 returns to a module already left: _keyspace > _table" in twice[0], twice
    assert "walk (13 stays)" in twice[-1], twice
    nested = walk_problems([b, m, b, k, t, k, b, t, b, lay, b])
    assert "2 returns to a module already left: _keyspace > _table" in nested[0], nested
    callback = walk_problems([b, m, b, k, values, t, values, k, b, t, b, lay, b])
    assert "entered from mfsdp_optim.checkpoint._state_dict._keyspace" in callback[0], callback


# ------------------------------------------------------------------------------------------
# the digest, now computed before any table exists, decides as the table's fingerprint did


def _variant(name: str):
    """A small optimizer state on a 1-rank mesh, changed in one way per ``name``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp_optim._infra.params import ParamRecord

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    names = ["a", "b", "c"] + (["extra"] if name == "extra_param" else [])
    dtype = {"bf16": torch.bfloat16}.get(name, torch.float32)
    params = {
        n: torch.nn.Parameter(distribute_tensor(torch.randn(4, 2, dtype=dtype), mesh, [Shard(0)]))
        for n in names
    }
    if name == "swapped":
        names = ["b", "a", "c"]
    held = [n for n in names if not (name == "c_not_held" and n == "c")]
    records = [ParamRecord(n, params[n], params[n] if n in held else None) for n in names]
    lr_b = {"lr_close": 0.010000001, "lr_int": 1, "lr_float": 1.0}.get(name, 0.01)
    if name == "split_equal":  # the same hyperparameters in two groups: the same table
        groups = [{"params": [params["a"]]}, {"params": [params[n] for n in held if n != "a"]}]
    else:
        groups = [{"params": [params[n] for n in held if n != "b"]}]
        groups.append({"params": [params["b"]], "lr": lr_b})
    opt = torch.optim.AdamW(groups, lr=0.01, amsgrad=(name == "amsgrad"))
    for n in held:
        if not (name == "c_unstepped" and n == "c"):
            params[n].grad = torch.ones_like(params[n])
    opt.step()
    if name == "step_differs":
        params["a"].grad = torch.ones_like(params["a"])
        for p in params.values():
            if p is not params["a"]:
                p.grad = None
        opt.step()
    return opt, records


_VARIANTS = [
    "base",
    "extra_param",
    "split_equal",
    "lr_close",
    "lr_int",
    "lr_float",
    "step_differs",
    "c_unstepped",
    "c_not_held",
    "bf16",
    "swapped",
    "amsgrad",
]


def _digests():
    """Per variant: what the digest hashes now, and what it hashed before (every record's tensor
    signature and the fingerprint of the table the rank would emit), computed independently."""
    from mfsdp_optim.checkpoint._state_dict._keyspace import describe_state, local_keyspace
    from mfsdp_optim.checkpoint._state_dict._materialize_optimizer_state import first_step_state
    from mfsdp_optim.checkpoint._state_dict._table import GroupMetaTable

    out = {}
    for name in _VARIANTS:
        opt, records = _variant(name)
        derived = first_step_state(opt, records, is_loading=False, init_state_fn=None)
        local = describe_state(opt, records, derived)
        signatures = {}
        for rec in records:
            entries = local.state.get(rec.fqn)
            if entries is not None:
                signatures[rec.fqn] = tuple(
                    sorted(
                        (k, s.dtype or "") if s.kind == "t" else (k, f"r:{s.dtype}:{s.value!r}")
                        for k, (s, _) in entries.items()
                        if s.kind in ("t", "r")
                    )
                )
            elif rec.opt_param is not None:
                signatures[rec.fqn] = ()
            else:
                signatures[rec.fqn] = derived[rec.param.dtype]
        table = GroupMetaTable.from_keyspace(local_keyspace(local))
        out[name] = (local.digest_items, (repr(tuple(signatures.items())), table.fingerprint()))
    return out


def test_the_digest_decides_as_the_table_fingerprint_did(ranks):
    [out] = ranks(1).run(_digests)
    for x in _VARIANTS:
        for y in _VARIANTS:
            now, before = out[x][0] == out[y][0], out[x][1] == out[y][1]
            assert now == before, (x, y, now, before)
    # the variants that must agree with the base do, the others do not
    agree = {x for x in _VARIANTS if out[x][0] == out["base"][0]}
    assert agree == {"base", "split_equal"}, agree


# ------------------------------------------------------------------------------------------
# the same bytes: the table as DCP pickles it, against the bytes of the build before the walk


def _table_bytes(rows_tiny: int) -> str:
    """SHA-256 of the table as ``torch.save`` pickles it (protocol 2), after a third step of
    ``a`` alone (two scalar leaves of one dtype: whether their dtype name is one shared string or
    two shows in the pickle)."""
    import hashlib
    import pickle

    opt, records = _setup(rows_tiny, True)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = None
    records[0].opt_param.grad = torch.ones_like(records[0].opt_param)
    opt.step()
    table = build_sharded_state_dict(opt, records)["param_to_group_meta"]
    return hashlib.sha256(pickle.dumps(table, protocol=2)).hexdigest()


# written by the build of d3a00f5 (before the walk) on the same setup
_BEFORE = {
    (1, 8): "232267f1ea08138e8eef7b247ad9653a1f26ff4c2ad4328ab558b1db2ca925fd",
    (2, 8): "232267f1ea08138e8eef7b247ad9653a1f26ff4c2ad4328ab558b1db2ca925fd",
    (2, 1): "232267f1ea08138e8eef7b247ad9653a1f26ff4c2ad4328ab558b1db2ca925fd",
}


@pytest.mark.parametrize(("world", "rows_tiny"), list(_BEFORE))
def test_the_table_pickles_to_the_bytes_it_did(ranks, world, rows_tiny):
    out = ranks(world).run(_table_bytes, rows_tiny)
    assert out == [_BEFORE[(world, rows_tiny)]] * world, out
