"""Every ``torch.optim`` class of the installed torch under the wrapper, on sharded layouts, next
to the same class stepping the unsharded params with the same global grads in one process.

Layouts (real gloo ranks): 1-D over 4 ranks with uneven and empty shards, HSDP 2x2
(``[Replicate, Shard(0)]``), 2-D ``[Shard(0), Shard(1)]``, and dense params over 4 ranks beside
"experts" on 2-rank stripes (each stripe its own tensors). Elementwise classes step local shards;
Muon and Adafactor step whole params; both must match the reference (bit for bit where the same
operations run on the same values). LBFGS and SparseAdam are refused at construction. The chain
test wraps Muon (2-D params) and AdamW (the rest) in one wrapper.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _layouts import OPTIMIZER_LAYOUTS, global_tensor, stripe_of, stripes
from _models import ELEMENTWISE_KWARGS

# (shape, mesh, used dims, placements): every param of a layout is 2-D so Muon takes them all
LAYOUTS = OPTIMIZER_LAYOUTS
WHOLE = {
    "Muon": dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True),
    "Adafactor": dict(lr=0.01),
}
STEPS = 3


def _seeded(specs, salt):
    return [dataclasses.replace(s, seed=1000 * i + salt) for i, s in enumerate(specs)]


def _rank_train(specs, name, kw, steps=STEPS):
    from _layouts import build_grad

    from mfsdp_optim.optim import FullyShardedOptimizer

    params = [torch.nn.Parameter(build_grad(s)) for s in _seeded(specs, 1)]
    opt = FullyShardedOptimizer(getattr(torch.optim, name)(params, **kw))
    for step in range(steps):
        for p, s in zip(params, _seeded(specs, 100 + step), strict=True):
            p.grad = build_grad(s, check=False)
        ok, _, _ = opt.step()
        assert ok
        opt.zero_grad()
    state = [
        {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in opt.state[p].items()}
        for p in params
    ]
    return [p.full_tensor() for p in params], state


def _reference(specs, name, kw, steps=STEPS):
    """{(param index, stripe): (param, state)} of the class on the unsharded params."""
    out = {}
    for i, spec in enumerate(_seeded(specs, 1)):
        for stripe in stripes(spec):
            p = torch.nn.Parameter(global_tensor(spec, stripe).clone())
            opt = getattr(torch.optim, name)([p], **kw)
            for step in range(steps):
                p.grad = global_tensor(_seeded(specs, 100 + step)[i], stripe).clone()
                opt.step()
            out[(i, stripe)] = (p.detach(), dict(opt.state[p]))
    return out


def _check(results, specs, ref, exact):
    for rank, (params, states) in enumerate(results):
        for i, spec in enumerate(specs):
            want_p, want_s = ref[(i, stripe_of(rank, spec))]
            where = f"rank {rank}, param {i}"
            if exact:
                assert torch.equal(params[i], want_p), f"{where}: params differ"
            else:
                torch.testing.assert_close(params[i], want_p, rtol=1e-6, atol=1e-7, msg=where)
            assert sorted(states[i]) == sorted(want_s), f"{where}: state keys"
            for k, v in want_s.items():
                got = states[i][k]
                if torch.is_tensor(v):
                    torch.testing.assert_close(got, v, rtol=1e-6, atol=1e-7, msg=f"{where} {k}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(ELEMENTWISE_KWARGS))
def test_elementwise_class_matches_unsharded(ranks, name, layout):
    specs = LAYOUTS[layout]
    results = ranks(4).run(_rank_train, specs, name, ELEMENTWISE_KWARGS[name])
    _check(results, specs, _reference(specs, name, ELEMENTWISE_KWARGS[name]), exact=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_param_class_matches_unsharded_bit_for_bit(ranks, name, layout):
    specs = LAYOUTS[layout]
    results = ranks(4).run(_rank_train, specs, name, WHOLE[name])
    _check(results, specs, _reference(specs, name, WHOLE[name]), exact=True)


def test_the_comparison_is_live(ranks):
    """Muon stepped on local slices (a subclass declared elementwise, wrongly: torch's own Muon
    cannot be declared so) fails the same check."""
    specs = LAYOUTS["1d-uneven-empty"]
    results = ranks(4).run(_rank_wrongly_elementwise, specs)
    with pytest.raises(AssertionError, match="params differ"):
        _check(results, specs, _reference(specs, "Muon", WHOLE["Muon"]), exact=True)


class _OwnStepMuon(torch.optim.Muon):
    """torch's Muon with its own step(): the package does not know it, so it may be declared."""

    def step(self, closure=None):
        return super().step(closure)


def _rank_wrongly_elementwise(specs):
    from _layouts import build_grad

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    params = [torch.nn.Parameter(build_grad(s)) for s in _seeded(specs, 1)]
    config = OptimizerConfig(update_kinds={_OwnStepMuon: "elementwise"})
    opt = FullyShardedOptimizer(_OwnStepMuon(params, **WHOLE["Muon"]), config)
    for step in range(STEPS):
        for p, s in zip(params, _seeded(specs, 100 + step), strict=True):
            p.grad = build_grad(s, check=False)
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in params], [dict(opt.state[p]) for p in params]


def _rank_refused(name):
    from _layouts import build_grad

    from mfsdp_optim.optim import FullyShardedOptimizer

    p = torch.nn.Parameter(build_grad(LAYOUTS["1d-uneven-empty"][0]))
    base = getattr(torch.optim, name)([p], lr=0.1)
    try:
        FullyShardedOptimizer(base)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam"])
def test_cross_param_and_sparse_classes_are_refused(ranks, name):
    for msg in ranks(4).run(_rank_refused, name):
        assert msg is not None and f"torch.optim.{name} cannot be wrapped" in msg


def test_every_installed_class_is_covered():
    """A torch that adds an optimizer class fails here until the class is placed."""
    known = set(ELEMENTWISE_KWARGS) | set(WHOLE) | {"LBFGS", "SparseAdam"}
    installed = {
        n
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and n != "Optimizer"
    }
    assert installed <= known, sorted(installed - known)
