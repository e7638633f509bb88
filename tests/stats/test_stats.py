"""The stats layer on real gloo ranks, against brute force over the distinct global tensors.

Every layout the strategies in ``_layouts`` draw (1-3-D meshes over 1, 2, 4 or 8 ranks;
Replicate, Shard and _StridedShard; uneven and empty shards; fp32/bf16/fp16; dense grads next to
expert grads on sub-meshes whose stripes hold different tensors) is built as real DTensors, checked
against ``full_tensor()``, and reduced by this package; every rank must return the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _collectives import counted
from _layouts import (
    DTYPES,
    GradSpec,
    PlacementSpec,
    build_grad,
    get_mesh,
    grad_specs,
    mesh_shapes,
    reference_stats,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import mfsdp_optim
from mfsdp_optim import clip_grads_with_norm_, count_replication, count_zeros, get_grad_norm

NORM_TYPES = [0.5, 1.0, 2.0, 3.0, math.inf]


def _as_py(stats):
    zeros = None if stats.num_zeros is None else int(stats.num_zeros)
    return (stats.total_norm.dtype, float(stats.total_norm), zeros, bool(stats.found_inf))


# ---------------------------------------------------------------------------------------------
# rank functions


def _rank_stats(specs, norm_type, want_zeros):
    grads = [build_grad(s) for s in specs]
    with counted() as counts:
        stats = mfsdp_optim.grad_stats(grads, norm_type=norm_type, count_zeros=want_zeros)
    return _as_py(stats), counts


def _rank_stats_some_ranks_empty(specs, holders, norm_type):
    """Only ranks in ``holders`` pass their grads; the others pass an empty iterable."""
    grads = [build_grad(s) for s in specs]
    mine = grads if dist.get_rank() in holders else []
    return _as_py(mfsdp_optim.grad_stats(mine, norm_type=norm_type, count_zeros=True))


def _rank_plant(specs, bad_rank, value, slot):
    grads = [build_grad(s) for s in specs]
    if dist.get_rank() == bad_rank:
        local = grads[slot]._local_tensor
        local.view(-1)[0] = value
    return _as_py(mfsdp_optim.grad_stats(grads, count_zeros=True))


def _rank_clip(specs, max_norm):
    grads = [build_grad(s) for s in specs]
    before = [g.full_tensor().double() for g in grads]
    norm = get_grad_norm(grads)
    # torch's convention: parameters in, their .grad scaled, their values untouched
    params = [torch.nn.Parameter(torch.full_like(g, 3.0)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # no grad: skipped
    with counted() as counts:
        clip_grads_with_norm_([*params, frozen], max_norm, norm)
    assert not counts, counts
    assert all(bool((p._local_tensor == 3.0).all()) for p in params), "a weight was scaled"
    assert bool((frozen == 1.0).all())
    after = [p.grad.full_tensor().double() for p in params]
    return float(norm), before, after


def _rank_bad_input(kind, bad_rank):
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = get_mesh((dist.get_world_size(),))
    good = DTensor.from_local(torch.ones(3), mesh, [Shard(0)], run_check=False)
    grads = [good]
    if dist.get_rank() == bad_rank or bad_rank is None:
        if kind == "plain":
            grads.append(torch.ones(3))
        elif kind == "partial":
            grads.append(DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False))
    try:
        stats = mfsdp_optim.grad_stats(grads)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", (float(stats.total_norm), bool(stats.found_inf))


def _rank_mesh_outside_group():
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    group = dist.new_group(list(range(world // 2)))  # every rank calls new_group
    mesh = get_mesh((world,))
    grad = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
    try:
        mfsdp_optim.grad_stats([grad], group=group)
    except ValueError as exc:
        return "ValueError", str(exc)
    return "no error", ""


def _rank_count_replication():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = get_mesh((2, 2))
    out = {}
    for name, placements in {
        "RS": [Replicate(), Shard(0)],
        "RR": [Replicate(), Replicate()],
        "SS": [Shard(0), Shard(1)],
        "strided": [_StridedShard(0, split_factor=2), Shard(0)],
    }.items():
        out[name] = count_replication(
            DTensor.from_local(torch.ones(2, 2), mesh, placements, run_check=False)
        )
    errors = {}
    for name, bad in {
        "plain": torch.ones(2),
        "partial": DTensor.from_local(torch.ones(2), mesh, [Partial(), Shard(0)], run_check=False),
    }.items():
        try:
            count_replication(bad)
        except (TypeError, ValueError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    return out, errors


# ---------------------------------------------------------------------------------------------
# strategies


@st.composite
def world_and_specs(draw, worlds=(1, 2, 4, 8), max_specs=4):
    world = draw(st.sampled_from(worlds))
    dense_mesh = draw(mesh_shapes(world))
    n = draw(st.integers(0, max_specs))
    specs = []
    for _ in range(n):
        # about half on the dense mesh, the rest on any mesh (sub-meshes and stripes included)
        mesh = dense_mesh if draw(st.booleans()) else None
        specs.append(draw(grad_specs(world, mesh)))
    return world, specs


# ---------------------------------------------------------------------------------------------
# tests


def _check_against_reference(results, specs, norm_type, want_zeros):
    ref_norm, ref_zeros, ref_inf = reference_stats(specs, norm_type)
    first = results[0][0]
    for stats, _ in results:
        assert stats == first, "ranks disagree"
    dtype, norm, zeros, found_inf = first
    assert dtype == torch.float32
    assert norm == pytest.approx(ref_norm, rel=2e-5, abs=1e-30)
    assert zeros == (ref_zeros if want_zeros else None)
    assert found_inf == ref_inf


@settings(max_examples=40)
@given(case=world_and_specs(), norm_type=st.sampled_from(NORM_TYPES), want_zeros=st.booleans())
def test_grad_stats_matches_brute_force_on_any_layout(ranks, case, norm_type, want_zeros):
    world, specs = case
    results = ranks(world).run(_rank_stats, specs, norm_type, want_zeros)
    _check_against_reference(results, specs, norm_type, want_zeros)
    for _, counts in results:
        assert sum(counts.values()) == 1, f"expected exactly one collective, saw {counts}"
        # the same collective whatever norm_type: ranks that differ cannot deadlock
        assert set(counts) <= {"all_gather_single", "all_gather_into_tensor"}, counts


def _dense_and_expert_specs(world=8, ep=2):
    """Dense grads over all ``world`` ranks next to expert grads on the (world/ep)-rank
    expert-data-parallel stripes of a (ep, edp) mesh: each stripe holds different experts."""
    edp = world // ep
    return [
        GradSpec((37, 5), (world,), (0,), (PlacementSpec("S", 0),), seed=1, zero_fraction=0.2),
        GradSpec((3,), (world,), (0,), (PlacementSpec("S", 0),), seed=2),  # empty shards
        GradSpec((11, 4), (ep, edp), (1,), (PlacementSpec("S", 0),), seed=3, dtype="bfloat16"),
        GradSpec((6,), (ep, edp), (1,), (PlacementSpec("R"),), seed=4, zero_fraction=0.5),
    ]


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
def test_dense_plus_expert_meshes_on_eight_ranks(ranks, norm_type):
    specs = _dense_and_expert_specs()
    results = ranks(8).run(_rank_stats, specs, norm_type, True)
    _check_against_reference(results, specs, norm_type, True)


def test_torch_clip_grad_norm_refuses_the_same_grads(ranks):
    """The gap this package fills: stock clip_grad_norm_ cannot take dense + expert grads."""
    results = ranks(4).run(_rank_torch_clip, _dense_and_expert_specs(world=4))
    assert all(r[0] == "raised" for r in results), results


def _rank_torch_clip(specs):
    grads = [build_grad(s) for s in specs]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    except Exception as exc:  # what exactly torch raises is its business
        return "raised", type(exc).__name__
    return "ok", ""


def test_ranks_without_grads_still_take_part(ranks):
    world = 4
    specs = [GradSpec((9, 2), (2, 2), (1,), (PlacementSpec("S", 0),), seed=7)]
    # ranks 0 and 1 form stripe 0 of the (2, 2) mesh; ranks 2 and 3 pass nothing
    results = ranks(world).run(_rank_stats_some_ranks_empty, specs, {0, 1}, 2.0)
    from _layouts import global_tensor

    g = global_tensor(specs[0], (0,)).double()
    for _dtype, norm, zeros, found_inf in results:
        assert norm == pytest.approx(float(g.norm()), rel=1e-6)
        assert zeros == int((g == 0).sum()) and not found_inf


def test_every_rank_empty_gives_zero(ranks):
    results = ranks(4).run(_rank_stats_some_ranks_empty, [], set(), 2.0)
    assert all(r == (torch.float32, 0.0, 0, False) for r in results)
    results = ranks(2).run(_rank_stats, [], math.inf, True)
    assert all(r[0] == (torch.float32, 0.0, 0, False) for r in results)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("slot,bad_rank", [(0, 3), (2, 1), (3, 2)])
def test_a_nonfinite_on_one_rank_is_seen_by_all(ranks, value, slot, bad_rank):
    """Slot 3 is replicated on its stripe: the bad value sits on a non-canonical replica."""
    specs = _dense_and_expert_specs(world=4)
    results = ranks(4).run(_rank_plant, specs, bad_rank, value, slot)
    for _, norm, _, found_inf in results:
        assert found_inf
        assert not math.isfinite(norm)


@settings(max_examples=15)
@given(case=world_and_specs(worlds=(2, 4)), max_norm=st.sampled_from([1e-3, 0.5, 1e6]))
def test_clip_matches_torch_on_the_global_tensors(ranks, case, max_norm):
    world, specs = case
    results = ranks(world).run(_rank_clip, specs, max_norm)
    norm = results[0][0]
    assert all(r[0] == norm for r in results), "ranks disagree on the norm"
    coef = min(1.0, max_norm / (norm + 1e-6))
    for _, before, got in results:  # stripes differ by rank: compare each rank with itself
        if not before:
            continue
        # torch's own clip on the global tensors this rank sees
        reference = [
            torch.nn.Parameter(torch.zeros_like(b, dtype=DTYPES[s.dtype]))
            for b, s in zip(before, specs, strict=True)
        ]
        for ref, b, s in zip(reference, before, specs, strict=True):
            ref.grad = b.to(DTYPES[s.dtype])  # the same dtype the sharded grads have
        torch.nn.utils.clip_grads_with_norm_(reference, max_norm, torch.tensor(norm))
        for g, ref, b, _s in zip(got, reference, before, specs, strict=True):
            torch.testing.assert_close(g.to(ref.grad.dtype), ref.grad, rtol=1e-6, atol=0.0)
            if coef < 1:
                assert not torch.equal(g, b) or not b.any()


def test_zero_count_exact_past_float32_integers(ranks):
    n = 2**24 + 5  # zeros; float32 counters would round this
    spec = GradSpec((n,), (2,), (0,), (PlacementSpec("S", 0),), zero_fraction=1.0, dtype="bfloat16")
    results = ranks(2).run(_rank_count_zeros, [spec])
    assert results == [n, n]


def _rank_count_zeros(specs):
    return int(count_zeros([build_grad(s, check=False) for s in specs]))


@pytest.mark.parametrize("kind", ["plain", "partial"])
def test_bad_input_on_one_rank_raises_there_and_everywhere_else(ranks, kind):
    results = ranks(4).run(_rank_bad_input, kind, 2, timeout=60)
    bad = results[2]
    assert bad[0] == ("TypeError" if kind == "plain" else "ValueError")
    assert "grads[1]" in bad[1]
    if kind == "partial":
        assert "Partial" in bad[1]
    for r in (0, 1, 3):  # no silent value: they raise, naming rank 2 and its error
        assert results[r][0] == "RankFailedError", results[r]
        assert "failed on rank 2 " in results[r][1] and bad[1][:80] in results[r][1]


def test_bad_input_on_every_rank_raises_everywhere(ranks):
    results = ranks(2).run(_rank_bad_input, "plain", None, timeout=60)
    assert all(r[0] == "TypeError" and "DTensor" in r[1] for r in results)


def test_mesh_with_ranks_outside_the_group_is_refused(ranks):
    results = ranks(4).run(_rank_mesh_outside_group, timeout=60)
    assert [status for status, _ in results] == ["ValueError"] * 4
    # ranks 0, 1 (in the group): their grad's mesh reaches ranks 2, 3, whose shards would be
    # missed; ranks 2, 3 (outside): they must not call at all. Two different refusals.
    for rank, (_, message) in enumerate(results):
        if rank < 2:
            assert "ranks [2, 3] are not in the grad-stats group" in message, message
        else:
            assert f"rank {rank} is not in the grad-stats group but called" in message, message


def test_count_replication(ranks):
    (out, errors), *_ = ranks(4).run(_rank_count_replication)
    assert out == {"RS": 2, "RR": 4, "SS": 1, "strided": 1}
    assert errors["plain"][0] == "TypeError" and "DTensor" in errors["plain"][1]
    assert errors["partial"][0] == "ValueError" and "Partial" in errors["partial"][1]


@settings(max_examples=15, deadline=None)
@given(
    kinds=st.lists(
        st.tuples(st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["S", "R"])),
        min_size=1,
        max_size=12,
    ),
    reuse=st.booleans(),
)
def test_bucketing_matches_a_per_grad_grouping(ranks, kinds, reuse):
    """``bucket_local_shards``'s list-wide fast path (one key) and its grouping loop (mixed
    keys) give what grouping every grad by (device, dtype, replication, canonical) gives, in
    order, for new specs and for cached ones alike."""
    results = ranks(2).run(_rank_bucketing, kinds, reuse)
    for got, want in results:
        assert got == want


def _rank_bucketing(kinds, reuse):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mfsdp_optim.stats._buckets import bucket_local_shards

    mesh = get_mesh((2,))
    grads = [
        DTensor.from_local(
            torch.full((2, 3), float(i), dtype=DTYPES[dtype]),
            mesh,
            [Shard(0) if placement == "S" else Replicate()],
        )
        for i, (dtype, placement) in enumerate(kinds)
    ]
    if reuse:
        bucket_local_shards(grads, None)  # the specs are cached now
    got = {k: [int(t[0, 0]) for t in v] for k, v in bucket_local_shards(grads, None).items()}
    want: dict = {}
    rank = dist.get_rank()
    for i, g in enumerate(grads):
        replicated = g.placements[0].is_replicate()
        key = (g._local_tensor.device, g._local_tensor.dtype, 2 if replicated else 1)
        key += (rank == 0 or not replicated,)
        want.setdefault(key, []).append(i)
    return got, want


def test_bucketing_follows_a_spec_that_changed_since_the_last_call(ranks):
    """``_parts_of`` remembers the last call's specs: a later call with the same grads but one
    grad re-laid (a new spec of another replication), with a plain tensor in one slot, or on
    another group, must not get the remembered parts or skip the validation."""
    for got, want in ranks(2).run(_rank_bucketing_after_a_change):
        assert got == want


def _rank_bucketing_after_a_change():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mfsdp_optim.stats._buckets import bucket_local_shards

    mesh = get_mesh((2,))
    rank = dist.get_rank()

    def grad(i, placement):
        return DTensor.from_local(torch.full((2, 3), float(i)), mesh, [placement])

    def summary(grads, group=None):
        buckets = bucket_local_shards(grads, group)
        return {k[2:]: [int(t[0, 0]) for t in v] for k, v in buckets.items()}

    grads = [grad(i, Shard(0)) for i in range(4)]
    got = [summary(grads), summary(grads)]  # the second call finds the remembered specs
    want = [{(1, True): [0, 1, 2, 3]}] * 2
    grads[2] = grad(2, Replicate())  # re-laid: 2 ranks hold it, rank 0 counts its zeros
    got.append(summary(grads))
    want.append({(1, True): [0, 1, 3], (2, rank == 0): [2]})
    got.append(summary(grads))  # remembered again, with the new spec
    want.append(want[-1])
    plain = list(grads)
    plain[1] = torch.zeros(2, 3)
    try:
        summary(plain)
        got.append("no error")
    except TypeError as exc:
        got.append("DTensor" in str(exc))
    want.append(True)
    # another group (this rank alone): the mesh spans ranks outside it, so it is refused
    alone = [dist.new_group([r]) for r in range(2)]  # every rank creates both, in order
    solo = alone[rank]
    try:
        summary(grads, solo)
        got.append("no error")
    except ValueError as exc:
        got.append("not in the grad-stats group" in str(exc))
    want.append(True)
    return got, want
