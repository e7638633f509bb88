"""FullyShardedOptimizer on any mesh layout (hypothesis): params and grads drawn as DTensor
layouts (1-3-D meshes, Replicate / Shard / _StridedShard, uneven and empty shards, sub-meshes
whose other dims are stripes of distinct tensors, as experts are, low-precision grads), trained a
few steps with clipping on real gloo ranks, with and without the empty-shard filter.

Reference: the plain torch optimizer over the distinct global tensors (one per stripe), in one
process, with ``clip_grad_norm_`` over all of them. Every rank must return the reference's grad
norm and hold the reference's params for its stripe. Adam, AdamW and SGD with momentum, foreach
and fused, so the fast step and the clip fold run on these layouts as well as the generic path
(RMSprop).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _layouts import global_tensor, grad_specs, mesh_shapes, stripe_of, stripes
from hypothesis import given, settings
from hypothesis import strategies as st

OPTIMIZERS = {
    "Adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "AdamW": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=0.01)),
}
MODES = {
    "Adam": ("foreach", "fused"),
    "AdamW": ("foreach", "fused"),
    "SGD": ("foreach", "fused"),
    "RMSprop": ("foreach",),
}
STEPS = 3


def _param_spec(spec):
    """The param of a grad layout: same layout, float32, its own values."""
    return dataclasses.replace(
        spec, dtype="float32", zero_fraction=0.0, scale=1.0, seed=spec.seed + 7919
    )


def _grad_spec(spec, step: int):
    return dataclasses.replace(spec, seed=spec.seed + 1_000_003 * (step + 1))


def _rank_train(specs, opt_name, mode, clip, norm_type, filter_empty):
    from _layouts import build_grad

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    cls, kw = OPTIMIZERS[opt_name]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    for p, s in zip(params, specs, strict=True):
        if s.dtype != "float32":
            p.grad_dtype = None  # low-precision grads of float32 params, as mixed precision has
    base = cls(params if params else [{"params": []}], **kw, **{mode: True})
    config = OptimizerConfig(clip_grad=clip, norm_type=norm_type, filter_empty_shards=filter_empty)
    opt = FullyShardedOptimizer(base, config)
    norms = []
    for step in range(STEPS):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False)
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
        for p, s in zip(params, specs, strict=True):
            assert p.grad.dtype == getattr(torch, s.dtype), "grad dtype restored"
        opt.zero_grad()
    return norms, [p.full_tensor() for p in params]


def _reference(specs, opt_name, mode, clip, norm_type):
    """Norms per step and the params per (spec index, stripe) of the plain optimizer."""
    cls, kw = OPTIMIZERS[opt_name]
    keys = [(i, stripe) for i, s in enumerate(specs) for stripe in stripes(s)]
    params = {k: torch.nn.Parameter(global_tensor(_param_spec(specs[k[0]]), k[1])) for k in keys}
    opt = cls(list(params.values()), **kw, **{mode: True}) if params else None
    norms = []
    for step in range(STEPS):
        for (i, stripe), p in params.items():
            p.grad = global_tensor(_grad_spec(specs[i], step), stripe).float()
        # torch's inf-norm refuses empty tensors; they add nothing to any norm
        filled = [p for p in params.values() if p.numel() > 0]
        if not filled:
            norm = 0.0
        elif clip:
            norm = float(torch.nn.utils.clip_grad_norm_(filled, clip, norm_type))
        else:
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in filled], norm_type))
        norms.append(norm)
        if opt is not None:
            opt.step()
    return norms, params


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    dense = draw(mesh_shapes(world))
    specs = [
        draw(grad_specs(world, dense if draw(st.booleans()) else None))
        for _ in range(draw(st.integers(0, 4)))
    ]
    opt_name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    mode = draw(st.sampled_from(MODES[opt_name]))
    clip = draw(st.sampled_from([0.0, 0.5, 1e6]))
    norm_type = draw(st.sampled_from([2.0, 1.0, math.inf]))
    return world, specs, opt_name, mode, clip, norm_type, draw(st.booleans())


@settings(max_examples=100)
@given(case=cases())
def test_wrapper_matches_plain_optimizer_on_any_layout(ranks, case):
    world, specs, opt_name, mode, clip, norm_type, filter_empty = case
    results = ranks(world).run(_rank_train, specs, opt_name, mode, clip, norm_type, filter_empty)
    _check(results, specs, _reference(specs, opt_name, mode, clip, norm_type))


def _check(results, specs, reference):
    ref_norms, ref_params = reference
    for rank, (norms, params) in enumerate(results):
        assert norms == results[0][0], f"rank {rank} disagrees on the norms"
        assert norms == pytest.approx(ref_norms, rel=2e-5, abs=1e-30), (norms, ref_norms)
        for i, (spec, got) in enumerate(zip(specs, params, strict=True)):
            want = ref_params[(i, stripe_of(rank, spec))].detach()
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, i=i, r=rank: f"rank {r}, param {i}: {m}",
            )


def test_the_comparison_is_live(ranks):
    """A reference that clips at another threshold must fail the same check."""
    from _layouts import GradSpec, PlacementSpec

    specs = [GradSpec((7, 3), (2,), (0,), (PlacementSpec("S", 0),), seed=5, scale=10.0)]
    results = ranks(2).run(_rank_train, specs, "Adam", "foreach", 0.5, 2.0, False)
    _check(results, specs, _reference(specs, "Adam", "foreach", 0.5, 2.0))
    with pytest.raises(AssertionError, match="param 0"):
        _check(results, specs, _reference(specs, "Adam", "foreach", 0.4, 2.0))
