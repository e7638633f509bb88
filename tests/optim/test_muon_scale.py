"""Muon at scale: bf16 tall matrices bit for bit, batched Newton-Schulz, owners over the world.

bf16 params of real transformer shapes (tall ``rows > columns`` and wide, scaled down from the
Llama-1B set so that CPU Newton-Schulz stays fast), sharded on 4 gloo ranks (1-D by rows, by
columns, HSDP 2x2, 2-D), stepped by the wrapper's whole-param Muon against torch's Muon on the
unsharded params fed the same global grads: every param and momentum buffer ``torch.equal`` after
each step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _layouts import GradSpec, PlacementSpec, build_grad, global_tensor, stripe_of

S0, S1, R = PlacementSpec("S", 0), PlacementSpec("S", 1), PlacementSpec("R")


def _spec(shape, mesh, placements, seed=0, dtype="bfloat16"):
    return GradSpec(
        tuple(shape), tuple(mesh), tuple(range(len(mesh))), tuple(placements), dtype, seed
    )


def _rank_muon(specs, steps, kw):
    from mfsdp_optim import FullyShardedOptimizer

    rank = dist.get_rank()
    module = torch.nn.Module()
    params, ref = [], []
    for i, s in enumerate(specs):
        init = dataclasses.replace(s, seed=s.seed + 7919)
        p = torch.nn.Parameter(build_grad(init))
        module.register_parameter(f"w{i}", p)
        params.append(p)
        ref.append(torch.nn.Parameter(global_tensor(init, stripe_of(rank, s))))
    opt = FullyShardedOptimizer(torch.optim.Muon(params, **kw), model_chunks=[module])
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
