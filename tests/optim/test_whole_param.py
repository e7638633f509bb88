"""The whole-param step (optim/_whole) against stock torch on the unsharded params.

Muon and Adafactor (and an unknown whole-param class) stepped through ``step_whole_params`` on
real gloo ranks, layouts drawn as ``_layouts.GradSpec`` (1-D uneven and empty shards, HSDP,
2-D, _StridedShard, experts on sub-meshes holding different values); reference: the same class
over this rank's stripe's global tensors in one process, compared with torch.equal. Pieces are
checked against DTensor's own ``full_tensor()``; traffic and owner balance are counted from the
pure planner over a Llama-1B-like set of matrices, and the runtime counter must agree with it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _layouts import GradSpec, PlacementSpec, grad_specs, stripes  # noqa: E402
from _ranks import get_pool  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mfsdp_optim.optim._whole import (  # noqa: E402
    ParamMeta,
    muon_splits,
    piece_of,
    plan_units,
)
from mfsdp_optim.optim._whole._pieces import piece_numel  # noqa: E402

S, R = PlacementSpec("S", 0), PlacementSpec("R")


class NormalizedSGD(torch.optim.Optimizer):
    """An unknown class whose update reads the whole param: p -= lr * g / ||g||."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st_ = self.state[p]
                    st_["count"] = st_.get("count", 0) + 1
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


OPTIMIZERS = {
    "Muon": (torch.optim.Muon, dict(lr=0.02, weight_decay=0.1)),
    "MuonPlain": (torch.optim.Muon, dict(lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw")),
    "Adafactor": (torch.optim.Adafactor, dict(lr=0.01, weight_decay=0.01)),
    "NormalizedSGD": (NormalizedSGD, dict(lr=0.1)),
}


def _spec(shape, mesh, placements, used=None, dtype="float32", seed=0):
    used = tuple(range(len(mesh))) if used is None else used
    return GradSpec(tuple(shape), tuple(mesh), used, tuple(placements), dtype=dtype, seed=seed)


def _param_spec(spec):
    return dataclasses.replace(spec, zero_fraction=0.0, scale=1.0, seed=spec.seed + 7919)


def _grad_spec(spec, step):
    return dataclasses.replace(spec, seed=spec.seed + 1_000_003 * (step + 1))


def _stripe_of(rank, spec):
    coord, rest = [], rank
    for size in reversed(spec.mesh_shape):
        coord.append(rest % size)
        rest //= size
    coord.reverse()
    return tuple(coord[d] for d in spec.stripe_dims)


def _full(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _rank_train(specs, opt_name, steps=3, break_it=False):
    import torch.distributed as dist
    from _layouts import build_grad, global_tensor

    from mfsdp_optim.optim._whole import TRAFFIC, muon_splits, step_whole_params
    from mfsdp_optim.optim._whole._pieces import describe, extract

    cls, kw = OPTIMIZERS[opt_name]
    rank = dist.get_rank()
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params if params else [{"params": []}], **kw)
    ref = [
        torch.nn.Parameter(global_tensor(_param_spec(s), _stripe_of(rank, s))) for s in specs
    ]
    ref_opt = cls(ref if ref else [{"params": []}], **kw)
    for p, r in zip(params, ref, strict=True):  # pieces: as DTensor holds them (build_grad checks)
        mesh = p.device_mesh
        piece = piece_of(tuple(p.shape), tuple(mesh.shape), tuple(mesh.get_coordinate()),
                         tuple(describe(pl, "p") for pl in p.placements))
        assert torch.equal(extract(r.detach(), piece), p._local_tensor), (p.placements, piece)
    plan = None
    TRAFFIC.clear()
    predicted = 0
    for step in range(steps):
        for p, r, s in zip(params, ref, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
            r.grad = global_tensor(_grad_spec(s, step), _stripe_of(rank, s)).to(p.dtype)
        plan = step_whole_params(opt, params, plan_cache=plan)
        ref_opt.step()
        if opt_name == "Muon":
            predicted += sum(muon_splits(plan.units, rank, plan.world)[0])
    if break_it:  # the check below must notice a one-ulp change
        params[0]._local_tensor.view(-1)[:1].add_(1e-3)
    for i, (p, r) in enumerate(zip(params, ref, strict=True)):
        assert torch.equal(p.full_tensor(), r.detach()), f"param {i} ({specs[i]})"
        mine, theirs = opt.state[p], ref_opt.state[r]
        assert list(mine) == list(theirs), (list(mine), list(theirs))
        for k, v in theirs.items():
            got = _full(mine[k])
            if isinstance(v, torch.Tensor):
                assert isinstance(got, torch.Tensor) and torch.equal(got, v), (i, k)
                if v.dim() > 0 and v.shape == r.shape:
                    assert got is not mine[k], "param-shaped state is a DTensor"
            else:
                assert got == v, (i, k)
    for g, saved in zip(opt.param_groups, [params], strict=False):
        assert all(a is b for a, b in zip(g["params"], saved, strict=True)), "lists restored"
    if opt_name == "Muon":
        assert TRAFFIC[("muon_in", "sent")] == predicted, (dict(TRAFFIC), predicted)
    return True


W4 = (4,)
LAYOUTS = {
    "1d-uneven-empty-2": (2, [_spec((5, 3), (2,), [S]), _spec((1, 4), (2,), [S], seed=1)]),
    "1d-uneven-empty-4": (
        4,
        [_spec((3, 5), W4, [S]), _spec((6, 2), W4, [PlacementSpec("S", 1)], seed=1)],
    ),
    "hsdp-2x2": (4, [_spec((5, 4), (2, 2), [R, S]), _spec((3, 7), (2, 2), [R, S], seed=2)]),
    "2d-shard-shard": (
        4,
        [_spec((5, 7), (2, 2), [S, PlacementSpec("S", 1)]), _spec((4, 3), (2, 2), [S, S], seed=3)],
    ),
    "strided": (
        4,
        [
            _spec((8, 3), (2, 2), [PlacementSpec("SS", 0, 2), S]),
            _spec((4, 6), (2, 2), [PlacementSpec("SS", 1, 2), PlacementSpec("S", 1)], seed=4),
        ],
    ),
    "dense-plus-experts": (
        4,
        [
            _spec((6, 5), W4, [S]),
            _spec((5, 3), (2, 2), [S], used=(1,), seed=5),
            _spec((3, 4), (2, 2), [PlacementSpec("S", 1)], used=(1,), seed=6),
        ],
    ),
}


@pytest.mark.parametrize("opt_name", ["Muon", "MuonPlain", "Adafactor", "NormalizedSGD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bit_for_bit_vs_unsharded(layout, opt_name):
    world, specs = LAYOUTS[layout]
    assert all(get_pool(world).run(_rank_train, specs, opt_name))


def test_bf16_muon_without_nesterov_aliases_the_buffer():
    specs = [_spec((6, 5), W4, [S], dtype="bfloat16"), _spec((3, 9), W4, [S], dtype="bfloat16")]
    assert all(get_pool(4).run(_rank_train, specs, "MuonPlain"))


def test_a_broken_update_is_noticed():
    with pytest.raises(AssertionError, match="param 0"):
        get_pool(2).run(_rank_train, LAYOUTS["1d-uneven-empty-2"][1], "Muon", break_it=True)
