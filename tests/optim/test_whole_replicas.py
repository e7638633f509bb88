"""The generic whole-param path over the replicas: one owner per param for all replica groups.

torch's Adafactor, an unknown class (``NormalizedSGD``) and third-party classes (pytorch-optimizer's
Lamb: whole-param norms and 0-d entries; MADGRAD: optimizer-level ``k``; Shampoo: whole
preconditioners larger than a piece) stepped through ``step_whole_params`` on 4 real gloo ranks
with HSDP layouts (2 replicas x 2 shards, a 3-D mesh whose Replicate dim is not the first,
uneven and empty shards, a replicated sub-mesh holding other values per stripe), the units
spanning the replicas (forced, and as the plan decides) against the same class on the unsharded
params fed the same global grads: every param and state entry ``torch.equal`` after each run.
The runtime's piece bytes equal the plan's count (``generic_splits``); from the plan alone, on
the Llama-1B-like set, the busiest rank's whole-param cost and each rank's bytes against one
unit per replica group. A grad present on one replica and None on the other raises on every
rank. Faults for the receiver role live in ``test_reliability_whole.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _layouts import PlacementSpec, grad_specs, stripe_of, valid_strided  # noqa: E402
from _models import llama_hsdp_metas
from _ranks import get_pool  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_whole_param import (  # noqa: E402
    OPTIMIZERS,
    _assert_like_reference,
    _full,
    _grad_spec,
    _param_spec,
    _spec,
)

from mfsdp_optim.optim._whole._pieces import piece_numel  # noqa: E402
from mfsdp_optim.optim._whole._plan import generic_splits, generic_traffic, plan_units  # noqa: E402

FULL = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
S0, S1, R = PlacementSpec("S", 0), PlacementSpec("S", 1), PlacementSpec("R")

THIRD_PARTY = {"Lamb": "lamb", "MADGRAD": "madgrad", "Shampoo": "shampoo"}


def _class(name):
    if name in THIRD_PARTY:
        import pytorch_optimizer as po

        return po.load_optimizer(THIRD_PARTY[name]), dict(lr=1e-2)
    return OPTIMIZERS[name]


def _needs(name):
    if name in THIRD_PARTY:
        pytest.importorskip("pytorch_optimizer")


# layouts on 4 ranks: (specs, whether every unit spans by default)
LAYOUTS = {
    # 2 replicas x 2 shards, even pieces: spans by default (more params than ranks: a plan with
    # fewer would keep an owner per replica group, test_more_ranks_than_large_params...); 2-D
    # Adafactor params (factored state, whole) and a 1-D one (param-shaped variance)
    "hsdp-2x2-even": (
        [
            _spec((6, 4), (2, 2), [R, S0]),
            _spec((8,), (2, 2), [R, S0], seed=1),
            _spec((4, 6), (2, 2), [R, S0], seed=7),
            _spec((2, 3), (2, 2), [R, S0], seed=8),
        ],
        True,
    ),
    # uneven (2 rows and 1) and empty (1 row and 0) pieces: per replica group by default
    "hsdp-2x2-uneven-empty": (
        [_spec((3, 4), (2, 2), [R, S0], seed=2), _spec((1, 5), (2, 2), [R, S0], seed=3)],
        False,
    ),
    # a 3-D mesh whose Replicate dim is the last: replica groups {0, 2} and {1, 3}
    "3d-replicate-last": (
        [
            _spec((4, 6), (2, 1, 2), [S0, S1, R], seed=4),
            _spec((6, 4), (2, 1, 2), [S1, S0, R], seed=5),
            _spec((2, 8), (2, 1, 2), [S0, S1, R], seed=9),
            _spec((8, 2), (2, 1, 2), [S0, S1, R], seed=10),
        ],
        True,
    ),
    # a replicated 1-D sub-mesh (each stripe its own values): a shard group of one rank
    "replicated-stripes": ([_spec((5, 3), (2, 2), [R], used=(1,), seed=6)], False),
}


def _rank_replicas(specs, opt_name, span, steps=3):
    """``steps`` steps through ``step_whole_params(span_replicas=span)`` against the unsharded
    run; returns the plan's (owner, members, receivers) per unit and the tensor bytes this rank
    handed to each generic exchange, per peer."""
    import torch.distributed as dist
    from _layouts import build_grad, global_tensor

    from mfsdp_optim.optim._whole import _generic, step_whole_params

    cls, kw = _class(opt_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    ref = [torch.nn.Parameter(global_tensor(_param_spec(s), stripe_of(rank, s))) for s in specs]
    ref_opt = cls(ref, **kw)
    sent = {"generic_in": [0] * world, "generic_out": [0] * world}
    real = _generic.exchange_records

    def counted(direction, records, status, group):
        for r, (_, tensors) in enumerate(records):
            if r != rank:
                sent[direction][r] += sum(t.numel() * t.element_size() for t in tensors)
        return real(direction, records, status, group)

    _generic.exchange_records = counted
    plan = None
    try:
        for step in range(steps):
            for p, r, s in zip(params, ref, specs, strict=True):
                p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
                r.grad = global_tensor(_grad_spec(s, step), stripe_of(rank, s)).to(p.dtype)
            plan = step_whole_params(opt, params, plan_cache=plan, span_replicas=span)
            ref_opt.step()
    finally:
        _generic.exchange_records = real
    _assert_like_reference(opt, ref_opt, params, ref, specs)
    assert plan is not None
    return [(u.owner, u.members, u.receivers) for u in plan.units], sent, plan.units


def _run(layout, opt_name, span, steps=3):
    _needs(opt_name)
    specs, spans_by_default = LAYOUTS[layout]
    out = get_pool(4).run(_rank_replicas, specs, opt_name, span, steps)
    units = out[0][0]
    assert all(o[0] == units for o in out), "ranks disagree about the plan"
    spanning = span if span is not None else spans_by_default
    # where the units span: one per param instance, the other replica groups receivers
    assert all(bool(receivers) == spanning for _, _, receivers in units), units
    return out


@pytest.mark.parametrize("span", [True, None], ids=["forced", "default"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("opt_name", ["Adafactor", "NormalizedSGD", "Lamb"])
def test_spanning_units_are_bit_for_bit_vs_unsharded(opt_name, layout, span):
    _run(layout, opt_name, span)


@pytest.mark.parametrize("opt_name", ["MADGRAD", "Shampoo"])
def test_third_party_state_over_the_replicas(opt_name):
    # MADGRAD: optimizer-level k and three param-shaped entries; Shampoo: whole
    # preconditioners, which every receiver gets whole
    _run("hsdp-2x2-even", opt_name, True)
    _run("3d-replicate-last", opt_name, None)


def test_the_runtime_sends_the_piece_bytes_the_plan_counts():
    # NormalizedSGD's state is a plain count (in the header): float32 param and grad in,
    # the param back; 3 steps
    for span in (True, False):
        out = _run("hsdp-2x2-even", "NormalizedSGD", span)
        units = out[0][2]
        for rank, (_, sent, _) in enumerate(out):
            send_in, _, send_out, _ = generic_splits(units, rank, 4, in_bytes=8, out_bytes=4)
            assert sent["generic_in"] == [3 * n for n in send_in], (span, rank, sent)
            assert sent["generic_out"] == [3 * n for n in send_out], (span, rank, sent)


# ---------------------------------------------------------------------------------------------
# a grad on one replica and None on the other


def _rank_replica_presence(specs, opt_name, span, none_on):
    import time

    import torch.distributed as dist
    from _layouts import build_grad

    from mfsdp_optim._infra.agreement import RankFailedError
    from mfsdp_optim.optim._whole import step_whole_params

    cls, kw = _class(opt_name)
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan = None
    for step in range(2):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
        if step == 1 and dist.get_rank() in none_on:
            params[0].grad = None
        before = [p._local_tensor.clone() for p in params]
        state = {k: _full(v).clone() for k, v in opt.state[params[0]].items() if torch.is_tensor(v)}
        t0 = time.monotonic()
        try:
            plan = step_whole_params(opt, params, plan_cache=plan, span_replicas=span)
        except (RankFailedError, ValueError) as exc:
            same = all(torch.equal(p._local_tensor, b) for p, b in zip(params, before, strict=True))
            same = same and all(
                torch.equal(_full(opt.state[params[0]][k]), v) for k, v in state.items()
            )
            kind = "RankFailedError" if isinstance(exc, RankFailedError) else type(exc).__name__
            return step, kind, str(exc), time.monotonic() - t0, same
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt_name", ["Adafactor", "NormalizedSGD"])
@pytest.mark.parametrize("layout", ["hsdp-2x2-even", "3d-replicate-last"])
def test_a_grad_on_one_replica_only_is_refused_on_every_rank(opt_name, layout):
    specs, _ = LAYOUTS[layout]
    # the whole second replica group lacks the grad: each shard group agrees within itself
    none_on = (2, 3) if layout == "hsdp-2x2-even" else (1, 3)
    out = get_pool(4).run(_rank_replica_presence, specs, opt_name, True, none_on)
    for rank, result in enumerate(out):
        assert result is not None, f"rank {rank} stepped through a grad on one replica only"
        step, kind, msg, seconds, same = result
        assert step == 1 and seconds < 10 and same, (rank, result)
        assert "grad is None on ranks" in msg and "param 'group0.param0'" in msg, (rank, msg)
        assert kind in ("ValueError", "RankFailedError"), (rank, kind)
    assert any(o[1] == "ValueError" for o in out), out  # the owner names it


# ---------------------------------------------------------------------------------------------
# hypothesis: HSDP layouts (a Replicate dim somewhere), spanning forced or as planned


@st.composite
def _cases(draw):
    opt_name = draw(st.sampled_from(["Adafactor", "NormalizedSGD"]))
    mesh = draw(st.sampled_from([(2, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1)]))
    specs = []
    for i in range(draw(st.integers(1, 3))):
        spec = draw(grad_specs(4, mesh, dtypes=("float32",), allow_stripes=False))
        placements = list(spec.placements)
        if not any(p.kind == "R" for p in placements):
            placements[draw(st.integers(0, len(placements) - 1))] = R
        shape = tuple(max(1, n) for n in spec.shape)  # empty params: nan in Adafactor either way
        spec = dataclasses.replace(
            spec, shape=shape, placements=tuple(placements), zero_fraction=0.0, seed=i
        )
        if any(p.kind == "SS" for p in spec.placements) and not valid_strided(spec):
            continue
        specs.append(spec)
    return opt_name, specs, draw(st.sampled_from([True, None]))


@pytest.mark.timeout(900 if FULL else 180)
@settings(max_examples=100 if FULL else 6, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_hypothesis_hsdp_layouts_over_the_replicas(case):
    opt_name, specs, span = case
    out = get_pool(4).run(_rank_replicas, specs, opt_name, span, 2)
    assert all(o[0] == out[0][0] for o in out)


# ---------------------------------------------------------------------------------------------
# from the plan alone: the Llama-1B-like set on HSDP


def _llama_hsdp_metas(world, replicas, layers=16):
    return llama_hsdp_metas(world, replicas, layers, dtype="torch.float32", norms=True)


def _adafactor_bytes(meta):
    """torch's Adafactor on float32: param and grad in (8 bytes an element); the param back,
    with the variance for a 1-D param (param-shaped) or the row and column factors whole for a
    2-D one, and the 0-d step."""
    if len(meta.shape) == 1:
        return 8 + 4, 4 + 4, 4
    return 8, 4, 4 * sum(meta.shape) + 4


def _traffic(units, rank, world):
    """One rank's (sent, received) piece bytes, from ``generic_splits`` per unit."""
    sent = received = 0
    for u in units:  # per unit: the bytes of its class state
        inb, outb, whole = _adafactor_bytes(u.meta)
        s_in, r_in, s_out, r_out = generic_splits([u], rank, world, inb, outb, whole)
        sent += sum(s_in) + sum(s_out)
        received += sum(r_in) + sum(r_out)
    return sent, received


def test_generic_traffic_is_the_sum_of_generic_splits():
    metas = _llama_hsdp_metas(8, 2, layers=2)
    for span in (True, False):
        units = plan_units([metas] * 8, "generic", span_replicas=span)
        totals = generic_traffic(units, 8, _adafactor_bytes)
        assert totals == [_traffic(units, rank, 8) for rank in range(8)]


# the figures docs/internals.md states, (world, replicas) -> (the busiest rank's cost over
# total / world, the most bytes any rank sends or receives over the same with one unit per
# replica group): one per replica group, the busiest rank does 2x / 4x the even share
FIGURES = {(8, 2): (1.0, 0.73), (8, 4): (1.0, 0.76), (64, 2): (1.03, 0.69), (64, 4): (1.03, 0.54)}


@pytest.mark.parametrize("world,replicas", sorted(FIGURES))
def test_the_generic_plan_over_the_replicas(world, replicas):
    metas = _llama_hsdp_metas(world, replicas)
    spanning = plan_units([metas] * world, "generic")
    per_replica = plan_units([metas] * world, "generic", span_replicas=False)
    assert len(spanning) == len(metas)  # the work is done once, whatever the replicas
    assert len(per_replica) == replicas * len(metas)
    total = sum(piece_numel(tuple((0, n) for n in m.shape)) for m in metas)

    def busiest(units):
        load = [0] * world
        for u in units:
            load[u.owner] += u.cost
        return max(load)

    cost_ratio, bytes_ratio = FIGURES[(world, replicas)]
    assert busiest(spanning) <= cost_ratio * total / world
    # one unit per replica group: each replica does all of it again
    assert busiest(per_replica) >= 0.95 * replicas * total / world
    # every rank sends and receives fewer bytes (Adafactor's state, float32)
    now = generic_traffic(spanning, world, _adafactor_bytes)
    before = generic_traffic(per_replica, world, _adafactor_bytes)
    for rank in range(world):
        assert now[rank][0] < before[rank][0] and now[rank][1] < before[rank][1], rank
    most_now, most_before = max(max(t) for t in now), max(max(t) for t in before)
    assert most_now <= bytes_ratio * most_before, most_now / most_before


@pytest.mark.parametrize(
    "world,replicas,spans",
    [(128, 2, False), (128, 4, True), (256, 4, False)] + ([(512, 2, False)] if FULL else []),
)
def test_more_ranks_than_large_params_keep_an_owner_per_replica_group(world, replicas, spans):
    # from about 128 ranks the set's largest matrices bound the busiest rank's work in both
    # plans; spanning then only adds bytes (its owner of a large matrix replies to every
    # replica), except where it still halves the work (128 x 4)
    metas = _llama_hsdp_metas(world, replicas)
    default = plan_units([metas] * world, "generic")
    spanning = plan_units([metas] * world, "generic", span_replicas=True)
    per_replica = plan_units([metas] * world, "generic", span_replicas=False)

    def busiest(units):
        load = [0] * world
        for u in units:
            load[u.owner] += u.cost
        return max(load)

    def most(units):  # param and grad in, param back: float32
        return max(map(max, generic_traffic(units, world, lambda m: (8, 4, 0))))

    if spans:
        assert default == spanning
        assert busiest(spanning) < busiest(per_replica)
    else:
        assert default == per_replica
        assert busiest(per_replica) <= busiest(spanning) and most(per_replica) < most(spanning)
