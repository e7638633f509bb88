"""Muon at scale: bf16 tall matrices bit for bit, batched Newton-Schulz, owners over the world.

bf16 params of real transformer shapes (tall ``rows > columns`` and wide, scaled down from the
Llama-1B set so that CPU Newton-Schulz stays fast), sharded on 4 gloo ranks (1-D by rows, by
columns, HSDP 2x2, 2-D), stepped by the wrapper's whole-param Muon against torch's Muon on the
unsharded params fed the same global grads: every param and momentum buffer ``torch.equal`` after
each step. Batched Newton-Schulz against torch's per-matrix function (CPU: bit for bit), and
through the wrapper. Owners spanning the replicas (one owner per matrix over every rank that
holds a copy, the result sent to every replica) on 8 ranks with 4 replicas, bit for bit; and,
from the planner alone, each rank's Newton-Schulz flops and exchange bytes for the 16-layer
Llama-1B set on 8 and 64 ranks with 1, 2 and 4 replicas against the issue's targets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _layouts import GradSpec, PlacementSpec, build_grad, global_tensor, stripe_of
from _models import llama_hsdp_metas

S0, S1, R = PlacementSpec("S", 0), PlacementSpec("S", 1), PlacementSpec("R")


def _spec(shape, mesh, placements, seed=0, dtype="bfloat16"):
    return GradSpec(
        tuple(shape), tuple(mesh), tuple(range(len(mesh))), tuple(placements), dtype, seed
    )


def _rank_muon(specs, steps, kw, config=None, batches=None):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim._whole import _muon

    if batches is not None:  # record the batch sizes of every batched call
        real = _muon.batched_newton_schulz

        def counted(stack, *args):
            batches.append(stack.shape[0])
            return real(stack, *args)

        _muon.batched_newton_schulz = counted

    rank = dist.get_rank()
    module = torch.nn.Module()
    params, ref = [], []
    for i, s in enumerate(specs):
        init = dataclasses.replace(s, seed=s.seed + 7919)
        p = torch.nn.Parameter(build_grad(init))
        module.register_parameter(f"w{i}", p)
        params.append(p)
        ref.append(torch.nn.Parameter(global_tensor(init, stripe_of(rank, s))))
    cfg = OptimizerConfig(**(config or {}))
    opt = FullyShardedOptimizer(torch.optim.Muon(params, **kw), cfg, model_chunks=[module])
    ref_opt = torch.optim.Muon(ref, **kw)
    diffs = []
    for step in range(steps):
        for p, r, s in zip(params, ref, specs, strict=True):
            g = dataclasses.replace(s, seed=s.seed + 1_000_003 * (step + 1))
            p.grad = build_grad(g, check=False)
            r.grad = global_tensor(g, stripe_of(rank, s))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for i, (p, r) in enumerate(zip(params, ref, strict=True)):
            full = p.full_tensor()
            buf = opt.optimizer.state[p]["momentum_buffer"].full_tensor()
            ref_buf = ref_opt.state[r]["momentum_buffer"]
            if not (torch.equal(full, r.detach()) and torch.equal(buf, ref_buf)):
                bad = int((full != r.detach()).sum())
                diffs.append((step, i, tuple(specs[i].shape), bad))
    return diffs


# Llama-1B's MLP and attention matrices, each dim / 8: 5632x2048 -> 704x256 (tall), its
# transpose (wide), 2048x2048 -> 256x256; plus a tall matrix whose rows do not split evenly
TALL, WIDE, SQUARE, ODD, WIDE_ODD = (704, 256), (256, 704), (256, 256), (300, 128), (100, 301)
LAYOUTS = {
    "rows-1d": ((4,), [S0]),
    "columns-1d": ((4,), [S1]),
    "hsdp-2x2": ((2, 2), [R, S0]),
    "2d": ((2, 2), [S0, S1]),
}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_muon_on_real_tall_shapes_is_bit_for_bit(ranks, layout, nesterov):
    mesh, placements = LAYOUTS[layout]
    specs = [
        _spec(shape, mesh, placements, seed=i) for i, shape in enumerate([TALL, WIDE, SQUARE, ODD])
    ]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for diffs in ranks(4).run(_rank_muon, specs, 2, kw):
        assert diffs == [], f"(step, param, shape, elements off): {diffs}"


@pytest.mark.xfail(
    reason="CPU only, bf16 only: torch's vectorised add_(alpha=...) computes the last "
    "numel % (2 * vector width) elements of a contiguous tensor in scalar code, which rounds "
    "differently; a shard boundary moves that tail, so a wide matrix whose shards do not "
    "split into whole vectors can be one bf16 step off on an element or two (CUDA has no "
    "such tail). Not the tall-matrix layout difference, which is fixed.",
    strict=False,
)
def test_bf16_muon_wide_matrix_with_a_ragged_cpu_vector_tail(ranks):
    specs = [_spec(WIDE_ODD, (4,), [S0], seed=4)]
    for diffs in ranks(4).run(_rank_muon, specs, 2, dict(lr=0.02, weight_decay=0.1)):
        assert diffs == [], f"(step, param, shape, elements off): {diffs}"


# Where each rank's piece of the result is added in torch's layout without a copy (a view of
# the owner's result, or a tall piece sent transposed) and where it must be copied: a tall
# matrix of one column (torch's operand is contiguous: the vectorised add), one-column pieces of
# a tall matrix (torch's is strided: the scalar add, which a one-column view would not take),
# tall pieces sent transposed, the whole matrix on one rank. Sizes in whole CPU vectors (a
# ragged tail rounds differently for another reason: see the xfail above).
RESULT_LAYOUTS = {
    "one-rank": (1, (1,), [S0], [(256, 1), (256, 48), (48, 256), (1, 256)]),
    "rows-1d": (4, (4,), [S0], [(256, 1), (256, 48), (48, 256)]),
    "columns-1d": (4, (4,), [S1], [(256, 4), (256, 48), (48, 256)]),
}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("layout", sorted(RESULT_LAYOUTS))
def test_each_piece_of_the_result_is_added_in_torchs_layout(ranks, layout, nesterov):
    world, mesh, placements, shapes = RESULT_LAYOUTS[layout]
    specs = [_spec(shape, mesh, placements, seed=i) for i, shape in enumerate(shapes)]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for diffs in ranks(world).run(_rank_muon, specs, 2, kw):
        assert diffs == [], f"(step, param, shape, elements off): {diffs}"


# ---------------------------------------------------------------------------------------------
# batched Newton-Schulz


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (64, 64), (1, 7), (7, 1)], ids=str)
def test_batched_newton_schulz_is_torchs_per_matrix_result_on_cpu(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    from mfsdp_optim.optim._whole._muon import batched_newton_schulz

    gen = torch.Generator().manual_seed(3)
    stack = torch.randn(4, *shape, generator=gen).bfloat16()
    stack[2] = 0  # a zero matrix: the eps clamp
    coefficients = (3.4445, -4.7750, 2.0315)
    ref_inputs = [stack[i].clone() for i in range(4)]
    ref = [_zeropower_via_newtonschulz(x, coefficients, 5, 1e-7) for x in ref_inputs]
    got_input = stack.clone()
    got, normalised = batched_newton_schulz(got_input, coefficients, 5, 1e-7)
    for i in range(4):
        assert torch.equal(got[i], ref[i]), i
        assert got[i].stride() == ref[i].stride(), "the layout torch returns (tall: transposed)"
        # torch normalises its bf16 input in place; the batch leaves the same values behind
        assert torch.equal(normalised[i], ref_inputs[i]) and torch.equal(
            got_input[i], ref_inputs[i]
        )
    with pytest.raises(ValueError, match="less than 100"):
        batched_newton_schulz(stack, coefficients, 100, 1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_newton_schulz_through_the_wrapper_is_bit_for_bit(ranks, nesterov):
    # several matrices of each shape on every owner (batches of 2 or more), tall, wide and
    # square, bf16 (the aliased momentum buffer without nesterov) and fp32
    shapes = [(96, 40)] * 8 + [(40, 96)] * 8 + [(64, 64)] * 4 + [(33, 7)]
    specs = [
        _spec(shape, (2, 2), [R, S0], seed=i, dtype="bfloat16" if i % 2 else "float32")
        for i, shape in enumerate(shapes)
    ]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    config = dict(batched_newton_schulz=True)
    results = ranks(4).run(_rank_batched, specs, kw, config)
    for diffs, _ in results:
        assert diffs == [], f"(step, param, shape, elements off): {diffs}"
    sizes = [b for _, batches in results for b in batches]
    assert sizes and max(sizes) >= 2, f"the batched path never batched: {sizes}"


def _rank_batched(specs, kw, config):
    batches: list[int] = []
    diffs = _rank_muon(specs, 2, kw, config, batches)
    return diffs, batches


# ---------------------------------------------------------------------------------------------
# owners over every rank that holds a copy


@pytest.mark.parametrize("dtype,nesterov", [("bfloat16", False), ("float32", True)])
def test_owners_across_four_replicas_are_bit_for_bit(ranks, dtype, nesterov):
    specs = [
        _spec(shape, (4, 2), [R, S0], seed=i, dtype=dtype)
        for i, shape in enumerate([(48, 20), (20, 48), (32, 32), (33, 7), (5, 9), (9, 5)])
    ]
    kw = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for diffs in ranks(8).run(_rank_muon, specs, 2, kw):
        assert diffs == [], f"(step, param, shape, elements off): {diffs}"


def _rank_owners(specs):
    from mfsdp_optim import FullyShardedOptimizer

    module = torch.nn.Module()
    params = []
    for i, s in enumerate(specs):
        p = torch.nn.Parameter(build_grad(s))
        module.register_parameter(f"w{i}", p)
        p.grad = build_grad(dataclasses.replace(s, seed=s.seed + 1))
        params.append(p)
    opt = FullyShardedOptimizer(torch.optim.Muon(params, lr=0.02), model_chunks=[module])
    opt.step()
    plan = opt._engines[0].whole_plan
    return [(u.owner, u.members, u.receivers) for u in plan.units]


def test_each_matrix_has_one_owner_over_all_replicas(ranks):
    specs = [_spec((16, 8), (4, 2), [R, S0], seed=i, dtype="float32") for i in range(8)]
    results = ranks(8).run(_rank_owners, specs)
    assert all(r == results[0] for r in results), "ranks disagree about the plan"
    units = results[0]
    assert len(units) == 8  # one per matrix, not one per matrix and replica
    assert sorted(owner for owner, _, _ in units) == list(range(8))  # every rank owns one
    for owner, members, receivers in units:
        assert owner in members and len(members) == 2 and len(receivers) == 6


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_the_plan_meets_the_issue_targets(world, replicas):
    from mfsdp_optim.optim._whole._pieces import piece_numel
    from mfsdp_optim.optim._whole._plan import muon_splits, plan_units

    metas = llama_hsdp_metas(world, replicas)
    units = plan_units([metas] * world, "muon")
    assert len(units) == len(metas)  # the work is done once, whatever the replicas

    def flops(shape):
        r, c = sorted(shape)
        return 5 * (4 * r * r * c + 2 * r**3)

    load = [0] * world
    for u in units:
        load[u.owner] += flops(u.meta.shape)
    even = sum(flops(m.shape) for m in metas) / world
    assert max(load) <= 1.15 * even, (max(load) / even, world, replicas)
    for rank in range(world):
        local = 2 * sum(
            piece_numel(u.piece_for(rank))
            for u in units
            if rank in u.members or rank in u.receivers
        )
        s_in, r_in, s_out, r_out = muon_splits(units, rank, world)
        assert sum(s_in) + sum(s_out) <= 1.1 * 2 * local, (rank, world, replicas)
        assert sum(r_in) + sum(r_out) <= 1.1 * 2 * local, (rank, world, replicas)


def _rank_fail_with_receivers(specs, bad_rank):
    import time

    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim._whole import step_whole_params

    params = [
        torch.nn.Parameter(build_grad(dataclasses.replace(s, seed=s.seed + 7))) for s in specs
    ]
    opt = torch.optim.Muon(params, lr=0.02)
    plan = None
    for step in range(2):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(dataclasses.replace(s, seed=s.seed + 100 * step), check=False)
        if step == 1 and dist.get_rank() == bad_rank:
            g = params[0].grad  # the same values claimed as Shard(1): a layout mismatch
            params[0].grad = DTensor.from_local(
                g.to_local(), g.device_mesh, [g.placements[0], Shard(1)], run_check=False,
                shape=g.shape, stride=g.stride(),
            )  # fmt: skip
        before = [p._local_tensor.clone() for p in params]
        t0 = time.monotonic()
        try:
            plan = step_whole_params(opt, params, plan_cache=plan)
        except (ValueError, RuntimeError) as exc:
            same = all(torch.equal(p._local_tensor, b) for p, b in zip(params, before, strict=True))
            return step, type(exc).__name__, str(exc), time.monotonic() - t0, same
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_rank", [0, 5])
def test_a_failing_member_or_receiver_stops_every_replica(ranks, bad_rank):
    # 4 replicas x 2 shards: every rank owns, sends input for and receives results of some
    # matrices; one rank's local failure must reach the owners and every receiver
    specs = [_spec((16, 8), (4, 2), [R, S0], seed=i, dtype="float32") for i in range(8)]
    out = ranks(8).run(_rank_fail_with_receivers, specs, bad_rank)
    for rank, result in enumerate(out):
        assert result is not None, f"rank {rank} stepped through a failed step"
        step, kind, msg, seconds, same = result
        assert step == 1 and seconds < 10, (rank, step, seconds)
        assert same, f"rank {rank}: a param changed on a refused step"
        if rank == bad_rank:
            assert kind == "ValueError" and "is not the param's" in msg, msg
        else:
            assert kind == "RankFailedError" and f"rank {bad_rank} " in msg, (rank, msg)
