"""Faults on the whole-param path (optim/_whole): no hang, no abort, nothing changed.

Muon, Adafactor and an unknown class (``NormalizedSGD``) on 4 real gloo ranks, layouts of
``test_whole_param.LAYOUTS``. One step runs clean (state exists), then a fault is put on some
ranks, where it bites at a different point of the step: before the step's agreement (a grad of
another layout or local shape, a hyperparameter the class's step would reject), in the pre-work
before the first exchange (state that raises), at the owner between the exchanges (a grad None
on some ranks only, Newton-Schulz or the class's own ``step()`` raising). The failing rank
catches its error and stays alive. Every rank must raise within 10 s (the failing ones their own
error, the others ``RankFailedError`` naming them), params, state and group values must be bit
for bit what they were on every rank, and a clean step right after must run on every rank.
The hypothesis sweep draws class, layout, fault, failing ranks and step;
``HYPOTHESIS_PROFILE=thorough`` runs it at full size, CI a fixed subset and a few examples.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ranks import get_pool  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_whole_param import LAYOUTS, OPTIMIZERS, S, _grad_spec, _param_spec, _spec  # noqa: E402

FULL = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
DEADLINE_S = 10.0
# how long a pool waits for every rank before it reports a hang (short to try old code quickly)
RUN_S = float(os.environ.get("MFSDP_WHOLE_FAULT_RUN_S", "60"))
# fault -> whether it is certain to fail the step (and on exactly the faulty ranks)
FAULTS = {
    "grad_layout": True,  # before the agreement: a grad claiming Shard(1)
    "grad_shape": True,  # before the agreement: a local grad one row longer than the param's
    "hyper": True,  # before the agreement: ns_steps=2.5 / ns_steps=100 / eps=(None, None)
    "state": True,  # pre-work before the first exchange (an owner may never get to read it)
    "grad_none": False,  # at the owner, after the first exchange (fails unless all ranks lack it)
    "compute": False,  # at the owner between the exchanges: Newton-Schulz / step() raises
}


class RaisingState(dict):
    """A param's state whose reads raise (the state of a broken checkpoint load, say)."""

    def get(self, *args, **kwargs):
        raise KeyError("state read failed on purpose")

    def items(self):
        raise KeyError("state read failed on purpose")


def _local(v):
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v._local_tensor
    return v.clone() if isinstance(v, torch.Tensor) else v


def _snapshot(opt, params):
    state = {}
    for i, p in enumerate(params):
        if p in opt.state:
            state[i] = {k: _local(v) for k, v in opt.state[p].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [p._local_tensor.clone() for p in params], state, groups, len(opt.state)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    return a == b


def _unchanged(before, after) -> list[str]:
    (p0, s0, g0, n0), (p1, s1, g1, n1) = before, after
    diffs = [f"param {i}" for i, (a, b) in enumerate(zip(p0, p1, strict=True)) if not _same(a, b)]
    if n0 != n1 or sorted(s0) != sorted(s1):
        diffs.append(f"state entries {sorted(s0)} -> {sorted(s1)} ({n0} -> {n1})")
    for i in s0.keys() & s1.keys():
        if list(s0[i]) != list(s1[i]):
            diffs.append(f"state {i} keys {list(s0[i])} -> {list(s1[i])}")
        diffs += [
            f"state {i}[{k!r}]" for k in s0[i] if k in s1[i] and not _same(s0[i][k], s1[i][k])
        ]
    if g0 != g1:
        diffs.append(f"groups {g0} -> {g1}")
    return diffs


def _inject(fault, opt_name, opt, params, bad):
    """Put the fault on this rank; returns how to take it away again."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    import mfsdp_optim.optim._whole._muon as muon_module

    if dist.get_rank() not in bad:
        return lambda: None
    p = params[0]
    g = p.grad
    if fault == "grad_layout":
        p.grad = DTensor.from_local(
            g.to_local(),
            g.device_mesh,
            [Shard(1)] * g.device_mesh.ndim,
            run_check=False,
            shape=g.shape,
            stride=g.stride(),
        )
    elif fault == "grad_shape":
        local = g.to_local()
        longer = torch.zeros((local.shape[0] + 1, *local.shape[1:]), dtype=local.dtype)
        p.grad = DTensor.from_local(
            longer, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
        )
    elif fault == "grad_none":
        p.grad = None
    elif fault == "hyper":
        key, value = {
            "Muon": ("ns_steps", 2.5 if dist.get_rank() % 2 else 100),
            "MuonPlain": ("ns_coefficients", (1.0, 2.0)),
            "Adafactor": ("eps", (None, None)),
            "NormalizedSGD": ("lr", "0.1"),
        }[opt_name]
        group = opt.param_groups[0]
        old = group[key]
        group[key] = value

        def undo():
            group[key] = old

        return undo
    elif fault == "state":
        had = p in opt.state
        old = opt.state.get(p)
        opt.state[p] = RaisingState(old or {})

        def undo():
            if had:
                opt.state[p] = old
            else:
                del opt.state[p]

        return undo
    elif fault == "compute":
        if opt_name.startswith("Muon"):
            real = muon_module._zeropower_via_newtonschulz

            def broken(*args, **kwargs):
                raise RuntimeError("Newton-Schulz failed on purpose")

            muon_module._zeropower_via_newtonschulz = broken

            def undo():
                muon_module._zeropower_via_newtonschulz = real

            return undo

        def raising_step(closure=None):
            raise RuntimeError(f"{opt_name}.step() failed on purpose")

        opt.step = raising_step

        def undo():
            del opt.step

        return undo
    return lambda: None


def _rank_fault(opt_name, layout, fault, bad, fault_step):
    from _layouts import build_grad

    from mfsdp_optim.optim._whole import step_whole_params

    _, specs = LAYOUTS[layout]
    cls, kw = OPTIMIZERS[opt_name]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan = None
    outcome = None
    for step in range(fault_step + 2):  # clean steps, the faulty one, a clean one after it
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
        if step != fault_step:
            plan = step_whole_params(opt, params, plan_cache=plan)
            continue
        inject = functools.partial(_inject, fault, opt_name, opt, params, bad)
        plan, outcome = _faulty_step(opt, params, plan, inject)
    return outcome  # the clean step after it ran on every rank (else the pool reports a hang)


def _faulty_step(opt, params, plan, inject, **kw):
    """The faulty step: the state snapshotted, ``inject()`` (which returns the fault's undo),
    the step, the undo. The plan, and ``[error class or "ok", message, seconds, what changed if
    it raised]``."""
    from mfsdp_optim._infra.agreement import RankFailedError
    from mfsdp_optim.optim._whole import step_whole_params

    before = _snapshot(opt, params)
    undo = inject()
    t0 = time.monotonic()
    try:
        plan = step_whole_params(opt, params, plan_cache=plan, **kw)
        outcome = ["ok", "", time.monotonic() - t0]
    except Exception as exc:
        name = "RankFailedError" if isinstance(exc, RankFailedError) else type(exc).__name__
        outcome = [name, str(exc), time.monotonic() - t0]
    finally:
        undo()
    outcome.append(_unchanged(before, _snapshot(opt, params)) if outcome[0] != "ok" else [])
    return plan, outcome


def _check(out, opt_name, fault, bad):
    certain = FAULTS[fault] and not (fault == "hyper" and opt_name == "NormalizedSGD")
    assert all(len(o) == 4 for o in out), out
    raised = [o[0] != "ok" for o in out]
    assert all(raised) or not any(raised), out
    if certain:
        assert all(raised), out
    if not any(raised):
        return
    own = {r for r, o in enumerate(out) if o[0] != "RankFailedError"}
    assert own, out
    assert own <= set(bad) or fault == "grad_none", (own, bad, out)  # the owner names them
    if certain and fault != "state":  # before the agreement: every faulty rank finds its own
        assert own == set(bad), (own, bad, out)
    for r, (_, message, seconds, diffs) in enumerate(out):
        assert seconds < DEADLINE_S, (r, seconds)
        assert not diffs, f"rank {r} changed {diffs} on a refused step"
        if r not in own:
            assert all(f"rank {f}: " in message for f in own), (r, own, message)


CASES = [  # a fixed subset for CI: every fault, each class, one and two failing ranks
    ("Muon", "dense-plus-experts", "grad_layout", (1,), 1),
    ("Muon", "hsdp-2x2", "grad_shape", (2,), 0),
    ("Muon", "dense-plus-experts", "hyper", (0, 3), 1),
    ("Muon", "2d-shard-shard", "state", (3,), 1),
    ("Muon", "dense-plus-experts", "grad_none", (1,), 1),
    ("Muon", "1d-uneven-empty-4", "compute", (0, 1, 2, 3), 0),
    ("Adafactor", "dense-plus-experts", "hyper", (2,), 1),
    ("Adafactor", "hsdp-2x2", "grad_none", (0,), 1),
    ("Adafactor", "strided", "compute", (1,), 1),
    ("NormalizedSGD", "dense-plus-experts", "compute", (3,), 0),
    ("NormalizedSGD", "2d-shard-shard", "state", (1, 2), 1),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_fault_on_some_ranks_refused_everywhere_nothing_changed(case):
    opt_name, layout, fault, bad, fault_step = case
    world = LAYOUTS[layout][0]
    out = get_pool(world).run(_rank_fault, opt_name, layout, fault, bad, fault_step, timeout=RUN_S)
    _check(out, opt_name, fault, bad)
    if fault in ("compute",) and len(bad) == world:
        assert all(o[0] != "ok" for o in out), out  # some rank owns a unit: it must bite


@st.composite
def _fault_cases(draw):
    opt_name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    world = LAYOUTS[layout][0]
    fault = draw(st.sampled_from(sorted(FAULTS)))
    bad = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
    return opt_name, layout, fault, bad, draw(st.integers(0, 1))


@pytest.mark.timeout(900 if FULL else 180)
@settings(max_examples=200 if FULL else 6, deadline=None)
@given(_fault_cases())
def test_hypothesis_which_rank_where_how(case):
    opt_name, layout, fault, bad, fault_step = case
    world = LAYOUTS[layout][0]
    out = get_pool(world).run(_rank_fault, opt_name, layout, fault, bad, fault_step, timeout=RUN_S)
    _check(out, opt_name, fault, bad)


# ---------------------------------------------------------------------------------------------
# inputs that used to abort gloo (sizes differing between ranks) or hang


def _rank_bf16_nesterov_differs(bad):
    import torch.distributed as dist
    from _layouts import build_grad

    from mfsdp_optim._infra.agreement import RankFailedError
    from mfsdp_optim.optim._whole import step_whole_params

    specs = [_spec((6, 5), (4,), [S], dtype="bfloat16")]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = torch.optim.Muon(params, lr=0.02, nesterov=dist.get_rank() != bad)
    for p, s in zip(params, specs, strict=True):
        p.grad = build_grad(_grad_spec(s, 0), check=False).to(p.dtype)
    before = _snapshot(opt, params)
    try:
        step_whole_params(opt, params)
        return "ok", ""
    except RankFailedError as exc:
        assert not _unchanged(before, _snapshot(opt, params))
        return "RankFailedError", str(exc)
    except ValueError as exc:
        assert not _unchanged(before, _snapshot(opt, params))
        return "ValueError", str(exc)


@pytest.mark.timeout(60)
def test_nesterov_differing_with_bf16_params_is_refused_not_aborted():
    out = get_pool(4).run(_rank_bf16_nesterov_differs, 2, timeout=RUN_S)
    assert all(o[0] != "ok" for o in out), out
    assert any(o[0] == "ValueError" and "nesterov" in o[1] for o in out), out


def _rank_muon_more_ranks_than_matrices(bad):
    """Muon over 2 matrices sharded over 4 ranks (two ranks own none), ns_steps=100 on ``bad``
    only: the ranks without a matrix to orthogonalise used to wait forever."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(4)))
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])) for _ in range(2)
    ]
    opt = torch.optim.Muon(params, lr=0.02)
    if dist.get_rank() == bad:
        opt.param_groups[0]["ns_steps"] = 100
    for p in params:
        p.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    from mfsdp_optim.optim._whole import step_whole_params

    t0 = time.monotonic()
    try:
        step_whole_params(opt, params)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, len(opt.state)
    return "ok", "", time.monotonic() - t0, len(opt.state)


@pytest.mark.timeout(60)
def test_ns_steps_100_on_one_rank_is_refused_before_any_change():
    out = get_pool(4).run(_rank_muon_more_ranks_than_matrices, 3, timeout=RUN_S)
    assert out[3][0] == "ValueError" and "ns_steps" in out[3][1], out
    for r in (0, 1, 2):
        assert out[r][0] == "RankFailedError" and "rank 3: " in out[r][1], out
    assert all(o[2] < DEADLINE_S and o[3] == 0 for o in out), out


def _rank_none_on_owner_only(opt_name):
    """The grad of param 0 is None on its owner only (the owner of this rank's unit)."""
    import torch.distributed as dist
    from _layouts import build_grad

    from mfsdp_optim._infra.agreement import RankFailedError
    from mfsdp_optim.optim._whole import step_whole_params

    _, specs = LAYOUTS["dense-plus-experts"]
    cls, kw = OPTIMIZERS[opt_name]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan = None
    for step in range(2):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False)
        if step == 1:
            owner = plan.units[plan.local_units[0]].owner
            if dist.get_rank() == owner:
                params[0].grad = None
            before = _snapshot(opt, params)
        try:
            plan = step_whole_params(opt, params, plan_cache=plan)
        except (RankFailedError, ValueError) as exc:
            return type(exc).__name__, str(exc), _unchanged(before, _snapshot(opt, params))
    return "ok", "", []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["Adafactor", "Muon"])
def test_grad_none_on_the_owner_only_is_refused_not_dropped(opt_name):
    out = get_pool(4).run(_rank_none_on_owner_only, opt_name, timeout=RUN_S)
    assert all(o[0] != "ok" and not o[2] for o in out), out
    assert any("grad is None on ranks" in o[1] for o in out), out


# ---------------------------------------------------------------------------------------------
# the agreed plan, through the wrapper: ranks that rebuilt alone, lists that differ


def _holder(params):
    holder = torch.nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"w{i}", p)
    return holder


def _chain_params():
    from _layouts import build_grad

    _, specs = LAYOUTS["dense-plus-experts"]
    specs = [specs[0], specs[0], specs[1], specs[2]]  # two same-shape dense matrices
    specs = [s.__class__(**{**s.__dict__, "seed": 10 + i}) for i, s in enumerate(specs)]
    return specs, [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]


def _wrapper_step(opt, params, specs, step):
    from _layouts import build_grad

    from mfsdp_optim._infra.agreement import RankFailedError, RankMismatchError

    for p, s in zip(params, specs, strict=True):
        p.grad = build_grad(_grad_spec(s, step), check=False)
    before = [_snapshot(o, params) for o in opt.optimizers]
    t0 = time.monotonic()
    try:
        opt.step()
        outcome = ["ok", ""]
    except (RankFailedError, RankMismatchError, ValueError) as exc:
        outcome = [type(exc).__name__, str(exc)]
    outcome.append(time.monotonic() - t0)
    after = [_snapshot(o, params) for o in opt.optimizers]
    changed = [d for b, a in zip(before, after, strict=True) for d in _unchanged(b, a)]
    outcome.append(changed if outcome[0] != "ok" else [])
    opt.zero_grad()
    return outcome


def _rank_plan_fault(fault):
    import torch.distributed as dist

    from mfsdp_optim.optim import FullyShardedOptimizer

    specs, params = _chain_params()
    muon = torch.optim.Muon(params[:3], lr=0.02)
    adamw = torch.optim.AdamW(params[3:], lr=0.01)
    opt = FullyShardedOptimizer([muon, adamw], model_chunks=[_holder(params)])
    out = [_wrapper_step(opt, params, specs, 0)]
    if dist.get_rank() == 1:
        if fault == "invalidate":
            opt.invalidate_caches()
        elif fault == "move_out":  # from Muon's group to AdamW's, on rank 1 only
            del muon.param_groups[0]["params"][2]
            adamw.param_groups[0]["params"].append(params[2])
        elif fault == "append_twice":
            adamw.param_groups[0]["params"].append(params[2])
    if fault == "append_twice_everywhere":
        adamw.param_groups[0]["params"].append(params[2])
    out.append(_wrapper_step(opt, params, specs, 1))
    out.append(_wrapper_step(opt, params, specs, 2))
    return out


@pytest.mark.timeout(60)
def test_plan_rebuilt_on_one_rank_is_refused_then_rebuilt_everywhere():
    out = get_pool(4).run(_rank_plan_fault, "invalidate", timeout=RUN_S)
    for r, (first, refused, after) in enumerate(out):
        assert first[0] == "ok" and after[0] == "ok", (r, out[r])
        assert refused[0] == "RankMismatchError" and "rebuilt the whole-param plan" in refused[1]
        assert "ranks [1] rebuilt" in refused[1] and refused[2] < DEADLINE_S and not refused[3]


@pytest.mark.timeout(60)
def test_param_moved_out_of_muon_on_one_rank_is_refused_everywhere():
    out = get_pool(4).run(_rank_plan_fault, "move_out", timeout=RUN_S)
    for r, (first, refused, again) in enumerate(out):
        assert first[0] == "ok", (r, out[r])
        assert refused[0] == "RankMismatchError" and not refused[3], (r, refused)
        # every rank rebuilds next: the plan itself now refuses the lists, on every rank
        assert again[0] == "ValueError" and "did not pass it" in again[1], (r, again)
        assert not again[3], (r, again)


@pytest.mark.timeout(60)
def test_param_appended_to_a_second_optimizer_is_refused_not_stepped_twice():
    out = get_pool(4).run(_rank_plan_fault, "append_twice_everywhere", timeout=RUN_S)
    for r, (first, refused, again) in enumerate(out):
        assert first[0] == "ok", (r, out[r])
        assert (
            refused[0] == "ValueError"
            and "'w2' is in optimizer[0] and optimizer[1]" in (refused[1])
        ), (r, refused)
        assert not refused[3] and again[0] == "ValueError", (r, out[r])
    # on one rank only: that rank refuses in its checks, the others hear of it
    out = get_pool(4).run(_rank_plan_fault, "append_twice", timeout=RUN_S)
    assert out[1][1][0] == "ValueError", out[1]
    assert all(o[1][0] == "RankFailedError" and not o[1][3] for r, o in enumerate(out) if r != 1)


def _rank_order(reverse_on, named):
    import torch.distributed as dist

    from mfsdp_optim.optim import FullyShardedOptimizer

    specs, params = _chain_params()
    mine = params[:2][::-1] if dist.get_rank() == reverse_on else params[:2]
    try:
        opt = FullyShardedOptimizer(
            torch.optim.Muon(mine, lr=0.02), model_chunks=[_holder(params)] if named else ()
        )
    except ValueError as exc:
        return str(exc)
    for step in range(2):
        _wrapper_step(opt, params[:2], specs[:2], step)
    return [p.full_tensor() for p in params[:2]]


@pytest.mark.timeout(60)
def test_same_shape_params_in_another_order():
    """Known by FQN, a rank listing them in another order gets the same result; named by
    position, they are refused at construction on every rank."""
    straight = get_pool(4).run(_rank_order, -1, True, timeout=RUN_S)
    swapped = get_pool(4).run(_rank_order, 2, True, timeout=RUN_S)
    for a, b in zip(straight, swapped, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    refused = get_pool(4).run(_rank_order, 2, False, timeout=RUN_S)
    assert all("Pass model_chunks" in m and "'param_groups.0.params.1'" in m for m in refused)


def _rank_list_without_chunks():
    from mfsdp_optim.optim import FullyShardedOptimizer

    _, params = _chain_params()
    try:
        FullyShardedOptimizer([torch.optim.Muon(params[:2]), torch.optim.AdamW(params[2:])])
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_list_of_optimizers_without_model_chunks_says_why():
    message = get_pool(4).run(_rank_list_without_chunks)[0]
    assert "without model_chunks" in message and "collide" in message, message
    assert "is in optimizer[0] and optimizer[1]" not in message


# ---------------------------------------------------------------------------------------------
# a grad None on some ranks only, on every path (checked inside the grad-stats collective)


def _rank_presence(opt_name, none_on):
    import torch.distributed as dist

    from mfsdp_optim.optim import FullyShardedOptimizer
    from mfsdp_optim.stats._reduce import GradPresenceError

    specs, params = _chain_params()
    base = {
        "AdamW": lambda: torch.optim.AdamW(params, lr=0.01),
        "AdamW-fused": lambda: torch.optim.AdamW(params, lr=0.01, fused=True),
        "Muon": lambda: torch.optim.Muon(params[:3], lr=0.02),
    }[opt_name]()
    chunks = [_holder(params)]
    opt = FullyShardedOptimizer(base, model_chunks=chunks)
    n = len(opt.param_groups[0]["params"])
    specs, params = specs[:n], params[:n]
    from _layouts import build_grad

    out = [_wrapper_step(opt, params, specs, 0)]
    for p, s in zip(params, specs, strict=True):
        p.grad = build_grad(_grad_spec(s, 1), check=False)
    if dist.get_rank() in none_on:
        params[0].grad = None
    before = _snapshot(base, params)
    t0 = time.monotonic()
    try:
        opt.step()
        out.append(["ok", "", time.monotonic() - t0, []])
    except GradPresenceError as exc:
        changed = _unchanged(before, _snapshot(base, params))
        out.append(["GradPresenceError", str(exc), time.monotonic() - t0, changed])
    opt.zero_grad()
    out.append(_wrapper_step(opt, params, specs, 2))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["AdamW", "AdamW-fused", "Muon"])
def test_grad_none_on_some_ranks_only_is_refused_on_every_path(opt_name):
    out = get_pool(4).run(_rank_presence, opt_name, (2,), timeout=RUN_S)
    for r, (first, refused, after) in enumerate(out):
        assert first[0] == "ok" and after[0] == "ok", (r, out[r])
        assert refused[0] == "GradPresenceError", (r, refused)
        assert "param 'w0' has a grad on ranks [0, 1, 3] and None on ranks [2]" in refused[1]
        assert refused[2] < DEADLINE_S and not refused[3], (r, refused)
    # None on every rank of its mesh: the param is skipped, as stock skips it
    out = get_pool(4).run(_rank_presence, opt_name, (0, 1, 2, 3), timeout=RUN_S)
    assert all(o[1][0] == "ok" for o in out), out


# ---------------------------------------------------------------------------------------------
# the up-front checks refuse what the class's step rejects, and nothing it accepts

MUON_VALUES = [
    ("ns_steps", 0, True),
    ("ns_steps", 99, True),
    ("ns_steps", True, True),
    ("ns_steps", 100, False),
    ("ns_steps", 2.5, False),
    ("ns_steps", "5", False),
    ("ns_coefficients", (3.0, -4.0, 2.0), True),
    ("ns_coefficients", [3.0, -4.0, 2.0], True),
    ("ns_coefficients", (3.0, -4.0), False),
    ("ns_coefficients", (3.0, -4.0, None), False),
]
ADAFACTOR_VALUES = [
    ("eps", (None, 1e-3), True),
    ("eps", (1e-30, 1e-3), True),
    ("eps", (None, 0), True),
    ("eps", (None, None), False),
    ("eps", (1e-30, "x"), False),
]


def _stock_accepts(cls, key, value) -> bool:
    """What torch's own class does with the value on a plain tensor (the reference)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([p], lr=0.01)
    opt.param_groups[0][key] = value
    p.grad = torch.randn(4, 3)
    try:
        opt.step()
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    "cls, key, value, ok",
    [(torch.optim.Muon, *v) for v in MUON_VALUES]
    + [(torch.optim.Adafactor, *v) for v in ADAFACTOR_VALUES],
)
def test_up_front_checks_match_the_class(cls, key, value, ok):
    from mfsdp_optim.optim._whole._checks import check_whole_hyperparameters

    assert _stock_accepts(cls, key, value) is ok  # the reference: torch's own step
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = cls([p], lr=0.01)
    opt.param_groups[0][key] = value
    if ok:
        check_whole_hyperparameters(opt)
    else:
        with pytest.raises((TypeError, ValueError), match=rf"param_groups\[0\]\['{key}'\]"):
            check_whole_hyperparameters(opt)


# ---------------------------------------------------------------------------------------------
# the receiver role: generic units spanning the replicas (test_whole_replicas.LAYOUTS)

# fault -> where it bites; every one is certain to fail the step
REPLICA_FAULTS = {
    "grad_layout": "before the agreement",
    "state": "pre-work (a receiver reads its state too) / the owner between the exchanges",
    "state_shape": "pre-work: a param-shaped entry of another local shape (a receiver never sends"
    " it, so only its own check sees it) / the owner's assembly",
    "grad_none": "the owner, after the first exchange (a receiver's flag)",
    "pack_in": "during the first exchange: this rank's records do not pack",
    "compute": "between the exchanges: the class's step() (owner: whole params; others: empty)",
    "pack_out": "during the second exchange: this rank's records do not pack",
    "assemble": "the owner after the first exchange: inserting the pieces raises",
    "unpicklable": "the owner during the second exchange: a group value that does not pickle",
}
OWNER_ONLY = {"assemble", "unpicklable"}  # only the owner gets there


def _inject_replica(fault, opt, params, target, bad):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim._whole import _exchange, _generic

    if dist.get_rank() not in bad:
        return lambda: None
    p = params[target]
    if fault in ("grad_layout", "grad_none", "state", "compute"):
        if fault == "grad_layout":  # the same values claimed as Shard(1) on every mesh dim
            g = p.grad
            p.grad = DTensor.from_local(
                g.to_local(), g.device_mesh, [Shard(1)] * g.device_mesh.ndim, run_check=False,
                shape=g.shape, stride=g.stride(),
            )  # fmt: skip
            return lambda: None
        return _inject(fault, "generic", opt, [p], bad)
    if fault == "state_shape":
        state = opt.state[p]
        key = next(k for k, v in state.items() if isinstance(v, DTensor) and v.shape == p.shape)
        old = state[key]
        local = old._local_tensor
        longer = torch.zeros((local.shape[0] + 1, *local.shape[1:]), dtype=local.dtype)
        state[key] = DTensor.from_local(
            longer, old.device_mesh, old.placements, run_check=False, shape=old.shape,
            stride=old.stride(),
        )  # fmt: skip

        def undo():
            state[key] = old

        return undo
    if fault == "unpicklable":
        group = opt.param_groups[0]
        group["on_purpose"] = lambda: None  # a local function: pickle refuses it

        def undo():
            del group["on_purpose"]

        return undo
    module, name, at = {
        "pack_in": (_exchange, "_packed", 0),
        "pack_out": (_exchange, "_packed", 1),
        "assemble": (_generic, "insert", None),
    }[fault]
    real = getattr(module, name)
    calls = [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if at is None or calls[0] - 1 == at:
            raise RuntimeError(f"{name} failed on purpose")
        return real(*args, **kwargs)

    setattr(module, name, broken)
    return lambda: setattr(module, name, real)


def _rank_replica_fault(opt_name, layout, fault, roles, hosted=False):
    """A clean step, the faulty one (on the given roles of the unit of the param the fault
    touches: its owner, a receiver, a member that is not the owner), a clean one after it.
    ``hosted``: every step as under ``host_sync=False`` (a ``DeviceVerdict``: the generic path
    sends its headers and status words through its host-side group)."""
    from _layouts import build_grad
    from test_whole_replicas import LAYOUTS as REPLICA_LAYOUTS
    from test_whole_replicas import _class

    from mfsdp_optim.optim._whole import DeviceVerdict, step_whole_params

    def mode():
        return {"verdict": DeviceVerdict(torch.device("cpu"))} if hosted else {}

    specs, _ = REPLICA_LAYOUTS[layout]
    cls, kw = _class(opt_name)
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan = None
    outcome: list = []
    for step in range(3):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
        if step != 1:
            plan = step_whole_params(opt, params, plan_cache=plan, span_replicas=True, **mode())
            continue
        assert plan is not None
        target = 1 if fault == "state_shape" else 0  # the 1-D param: a param-shaped entry
        unit = plan.units[plan.local_units[target]]
        assert unit.receivers, "the unit spans the replicas"
        holders = {
            "owner": unit.owner,
            "receiver": unit.receivers[-1],
            "member": next(m for m in unit.members if m != unit.owner),
        }
        bad = sorted({holders[r] for r in roles})
        inject = functools.partial(_inject_replica, fault, opt, params, target, bad)
        plan, outcome = _faulty_step(opt, params, plan, inject, span_replicas=True, **mode())
        outcome.append((bad, unit.owner))
    return outcome  # the clean step after it ran on every rank (else the pool reports a hang)


def _check_replica(out, fault):
    assert all(len(o) == 5 for o in out), out
    assert all(o[0] != "ok" for o in out), f"a rank stepped through the fault: {out}"
    bad, owner = out[0][4]
    own = {r for r, o in enumerate(out) if o[0] != "RankFailedError"}
    # the failing ranks raise their own error (where one fails first, the others may not get to
    # theirs); a grad missing on one holder is the owner's
    if fault == "grad_none":
        assert own == {owner}, (own, owner, out)
    else:
        assert own and own <= set(bad), (own, bad, out)
        if len(bad) == 1:
            assert own == set(bad), (own, bad, out)
    for r, (_, message, seconds, diffs, _) in enumerate(out):
        assert seconds < DEADLINE_S, (r, seconds)
        assert not diffs, f"rank {r} changed {diffs} on a refused step"
        if r not in own:
            assert all(f"rank {f}: " in message for f in own), (r, own, message)
    if fault == "grad_none":
        assert "grad is None on ranks" in out[owner][1], out[owner]


def _replica_case(fault, roles):
    """Adafactor on HSDP 2x2; a member's fault with the unknown class on the 3-D mesh (the
    state-shape fault needs Adafactor's param-shaped entry: the 1-D param of HSDP 2x2)."""
    if roles != ("member",) or fault == "state_shape":
        return ("Adafactor", "hsdp-2x2-even", fault, roles)
    return ("NormalizedSGD", "3d-replicate-last", fault, roles)


REPLICA_CASES = [  # every fault on a receiver, on the owner, on a member, on two of them
    _replica_case(fault, roles)
    for fault in REPLICA_FAULTS
    for roles in [("receiver",), ("owner",), ("member",), ("owner", "receiver")]
    if fault not in OWNER_ONLY or roles == ("owner",)
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case", REPLICA_CASES, ids=["-".join([c[0], c[1], c[2], "+".join(c[3])]) for c in REPLICA_CASES]
)
def test_fault_on_a_receiver_or_owner_refused_on_every_replica(case):
    opt_name, layout, fault, roles = case
    out = get_pool(4).run(_rank_replica_fault, opt_name, layout, fault, roles, timeout=RUN_S)
    _check_replica(out, fault)


@st.composite
def _replica_fault_cases(draw):
    fault = draw(st.sampled_from(sorted(REPLICA_FAULTS)))
    roles = ("owner",)
    if fault not in OWNER_ONLY:
        roles = tuple(
            sorted(draw(st.sets(st.sampled_from(["owner", "receiver", "member"]), min_size=1)))
        )
    if fault == "state_shape":  # Adafactor's param-shaped entry: the 1-D param of HSDP 2x2
        return "Adafactor", "hsdp-2x2-even", fault, roles
    opt_name = draw(st.sampled_from(["Adafactor", "NormalizedSGD"]))
    layout = draw(st.sampled_from(["hsdp-2x2-even", "3d-replicate-last"]))
    return opt_name, layout, fault, roles


@pytest.mark.timeout(900 if FULL else 180)
@settings(max_examples=150 if FULL else 6, deadline=None)
@given(_replica_fault_cases())
def test_hypothesis_replica_faults(case):
    opt_name, layout, fault, roles = case
    out = get_pool(4).run(_rank_replica_fault, opt_name, layout, fault, roles, timeout=RUN_S)
    _check_replica(out, fault)
