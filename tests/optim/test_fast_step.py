"""The Adam/AdamW fast step of FullyShardedOptimizer (``_fast_step``): bit-identical params and
state to the generic path (torch's own ``step()`` on the aliases), taken when it should be and
not otherwise.

Bit-exactness runs on a world-size-1 gloo rank (DTensor params on a 1-rank mesh): two identical
param sets, one wrapper with the fast path and one forced onto the generic path
(``MFSDP_OPTIM_DISABLE_FAST_STEP=1``), the same grads, several steps, and ``torch.equal`` on every
param and state tensor. A 2-rank run checks training equivalence against an unsharded reference.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch

SHAPES = [(6, 4), (3,), (5, 2, 3), (0, 4), (7, 1)]  # (0, 4): an empty local shard
CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


@contextlib.contextmanager
def _generic():
    """Force the generic path while the block runs."""
    from mfsdp_optim.optim._engines._route import DISABLE_FAST_STEP_ENV as DISABLE_ENV

    old = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = old


def _dparams(seed: int):
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = get_mesh((1,))
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(
            DTensor.from_local(torch.randn(s, generator=gen), mesh, [Shard(0)], run_check=False)
        )
        for s in SHAPES
    ]


def _set_grads(params, step: int, *, bf16: bool, scale: float, inf: bool):
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * scale
        if bf16 and i % 2 == 0:
            g = g.to(torch.bfloat16)
            p.grad_dtype = None  # allow a grad dtype other than the param's
        if inf and i == 0:
            g.view(-1)[0] = float("inf")
        if i == 4 and step % 3 == 1:  # now and then a param without a grad
            p.grad = None
            continue
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)


def _make(cls, kw, params, extras):
    from mfsdp_optim.optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    kw = dict(kw)
    if torch.is_tensor(kw["lr"]):
        kw["lr"] = kw["lr"].clone()
    scaler = DynamicGradScaler(initial_scale=2.0**8, hysteresis=1) if extras["scaler"] else None
    return FullyShardedOptimizer(
        cls(params, **kw),
        OptimizerConfig(clip_grad=extras["clip"], filter_empty_shards=extras["filter"]),
        grad_scaler=scaler,
    )


def _assert_same(tag, fast, slow, pa, pb):
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        assert torch.equal(a._local_tensor, b._local_tensor), f"{tag}: param {i}"
        if a.grad is not None:
            assert a.grad._local_tensor.dtype == b.grad._local_tensor.dtype
            assert torch.equal(a.grad._local_tensor, b.grad._local_tensor), f"{tag}: grad {i}"
    sa = [fast.state.get(a._local_tensor) for a in pa]
    sb = [slow.state.get(b._local_tensor) for b in pb]
    for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
        assert (x is None) == (y is None), f"{tag}: state presence {i}"
        if x is None:
            continue
        assert set(x) == set(y), f"{tag}: state keys {i}"
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].device == y[k].device, f"{tag}: {k} {i}"
            assert torch.equal(x[k], y[k]), f"{tag}: state {i} {k}"


def _run_pair(cls, kw, extras, steps=5):
    """Train the fast and the generic wrapper side by side; return (fast_steps, generic_steps,
    successful updates)."""
    pa, pb = _dparams(0), _dparams(0)
    fast, slow = _make(cls, kw, pa, extras), _make(cls, kw, pb, extras)
    ok_count = 0
    for step in range(steps):
        grad_kw = dict(
            bf16=extras["bf16"],
            scale=(2.0**8 if extras["scaler"] else 1.0),
            inf=extras["scaler"] and step == 2,
        )
        _set_grads(pa, step, **grad_kw)
        _set_grads(pb, step, **grad_kw)
        ra = fast.step()
        with _generic():
            rb = slow.step()
        assert ra[0] == rb[0] and (ra[1] == rb[1] or ra[1] != ra[1]), (ra, rb)
        ok_count += ra[0]
        _assert_same(f"{cls.__name__} {kw} {extras} step {step}", fast, slow, pa, pb)
        fast.zero_grad()
        slow.zero_grad()
    return fast.fast_steps, slow.fast_steps, ok_count


def _configs():
    for name, mode, amsgrad, maximize, wd, lr_tensor in itertools.product(
        CLASSES, ("fused", "foreach"), (False, True), (False, True), (0.0, 0.1), (False, True)
    ):
        if mode == "foreach" and lr_tensor:
            continue  # torch rejects a tensor lr for foreach without capturable (tested below)
        kw = dict(
            lr=torch.tensor(0.01) if lr_tensor else 0.01,
            betas=(0.8, 0.95),
            eps=1e-6,
            weight_decay=wd,
            amsgrad=amsgrad,
            maximize=maximize,
            **{mode: True},
        )
        yield name, kw


def _rank_bit_exact(extras_list):
    out = []
    for name, kw in _configs():
        for extras in extras_list:
            n_fast, n_slow, n_ok = _run_pair(CLASSES[name], kw, extras)
            out.append((name, n_fast, n_slow, n_ok))
    return out


EXTRAS = [
    dict(clip=0.0, scaler=False, bf16=False, filter=False),
    dict(clip=0.5, scaler=True, bf16=True, filter=True),
    dict(clip=0.5, scaler=False, bf16=True, filter=False),
]


@pytest.mark.parametrize("extras", EXTRAS, ids=["plain", "clip-scaler-bf16-filter", "clip-bf16"])
def test_fast_step_bit_identical(ranks, extras):
    (results,) = ranks(1).run(_rank_bit_exact, [extras], timeout=600)
    assert len(results) == 48  # 2 classes x (16 fused incl. tensor lr + 8 foreach)
    for name, n_fast, n_slow, n_ok in results:
        assert n_slow == 0, name
        if extras["scaler"]:
            # step 0 creates the state (generic), step 2 overflows (skipped, counter unchanged)
            assert n_ok == 4 and n_fast == 3, (name, n_fast, n_ok)
        else:
            assert n_ok == 5 and n_fast == 4, (name, n_fast, n_ok)


# ---------------------------------------------------------------------------------------------
# when the fast path is (not) taken


def _rank_when_taken():
    from mfsdp_optim.optim import FullyShardedOptimizer

    out = {}
    no_scaler = dict(bf16=False, scale=1.0, inf=False)

    def train(opt, params, steps=3, start=0):
        for step in range(start, start + steps):
            _set_grads(params, step, **no_scaler)
            opt.step()
            opt.zero_grad()
        return opt.fast_steps

    # a subclass of AdamW: generic
    class MyAdamW(torch.optim.AdamW):
        pass

    p = _dparams(0)
    out["subclass"] = train(FullyShardedOptimizer(MyAdamW(p, lr=0.01, fused=True)), p)

    # a base-optimizer step hook: generic while it is registered, and it runs
    p = _dparams(0)
    opt = FullyShardedOptimizer(torch.optim.AdamW(p, lr=0.01, fused=True))
    calls = []
    handle = opt.optimizer.register_step_post_hook(lambda *a: calls.append(1))
    out["hooked"] = train(opt, p)
    out["hook_calls"] = len(calls)
    handle.remove()
    out["unhooked"] = train(opt, p, start=3)
    pre = opt.optimizer.register_step_pre_hook(lambda *a: None)
    out["pre_hooked"] = train(opt, p, start=6) - out["unhooked"]
    pre.remove()

    # a global optimizer hook fires once per wrapper step (around it), so the fast path stays
    from torch.optim.optimizer import register_optimizer_step_post_hook

    p = _dparams(0)
    opt = FullyShardedOptimizer(torch.optim.Adam(p, lr=0.01, foreach=True))
    global_calls = []
    h = register_optimizer_step_post_hook(lambda o, *a: global_calls.append(type(o).__name__))
    try:
        out["global_hook"] = (train(opt, p), global_calls)
    finally:
        h.remove()
    out["global_removed"] = train(opt, p, start=3) - out["global_hook"][0]

    # the wrapper's own hooks do not matter (they run around the wrapper's step)
    p = _dparams(0)
    opt = FullyShardedOptimizer(torch.optim.Adam(p, lr=0.01, fused=True))
    own = []
    opt.register_step_post_hook(lambda *a: own.append(1))
    out["own_hook"] = (train(opt, p), len(own))

    # foreach=None / capturable / non-Adam: generic
    p = _dparams(0)
    out["default_impl"] = train(FullyShardedOptimizer(torch.optim.Adam(p, lr=0.01)), p)
    p = _dparams(0)
    out["sgd"] = train(FullyShardedOptimizer(torch.optim.SGD(p, lr=0.01, foreach=True)), p)

    # the escape hatch
    p = _dparams(0)
    opt = FullyShardedOptimizer(torch.optim.AdamW(p, lr=0.01, fused=True))
    with _generic():
        out["env_disabled"] = train(opt, p)

    # an lr scheduler on the wrapper keeps the fast path and sees the new lr
    p, q = _dparams(0), _dparams(0)
    a = FullyShardedOptimizer(torch.optim.AdamW(p, lr=0.01, fused=True))
    b = FullyShardedOptimizer(torch.optim.AdamW(q, lr=0.01, fused=True))
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(b, step_size=1, gamma=0.5)
    for step in range(4):
        _set_grads(p, step, **no_scaler)
        _set_grads(q, step, **no_scaler)
        a.step()
        with _generic():
            b.step()
        sa.step()
        sb.step()
        a.zero_grad()
        b.zero_grad()
    _assert_same("scheduler", a, b, p, q)
    out["scheduler"] = (a.fast_steps, b.fast_steps)

    # foreach with a tensor lr: torch's error on both paths
    errors = []
    for generic in (False, True):
        p = _dparams(0)
        opt = FullyShardedOptimizer(torch.optim.Adam(p, lr=0.01, foreach=True))
        train(opt, p, steps=1)  # the state exists: the next step could be fast
        opt.param_groups[0]["lr"] = torch.tensor(0.01)  # Adam's constructor refuses it
        _set_grads(p, 1, **no_scaler)
        try:
            with _generic() if generic else contextlib.nullcontext():
                opt.step()
        except RuntimeError as exc:
            errors.append(str(exc))
    out["tensor_lr_foreach"] = errors
    return out


def test_when_fast_path_is_taken(ranks):
    (out,) = ranks(1).run(_rank_when_taken)
    assert out["subclass"] == 0
    assert out["hooked"] == 0 and out["hook_calls"] == 3
    assert out["unhooked"] == 3  # the state exists already: every step is fast
    assert out["pre_hooked"] == 0
    assert out["global_hook"] == (2, ["FullyShardedOptimizer"] * 3)  # step 1 creates state
    assert out["global_removed"] == 3
    assert out["own_hook"] == (2, 3)
    assert out["default_impl"] == 0 and out["sgd"] == 0
    assert out["env_disabled"] == 0
    assert out["scheduler"] == (3, 0)
    assert len(out["tensor_lr_foreach"]) == 2
    assert out["tensor_lr_foreach"][0] == out["tensor_lr_foreach"][1]
    assert "lr as a Tensor is not supported" in out["tensor_lr_foreach"][0]


# ---------------------------------------------------------------------------------------------
# cache invalidation


def _rank_invalidation():
    from torch.distributed.tensor import DTensor

    from mfsdp_optim.optim import FullyShardedOptimizer

    no_scaler = dict(bf16=False, scale=1.0, inf=False)
    out = {}
    p, q = _dparams(0), _dparams(0)
    # a group added later (model_chunks name it: the default names would collide)
    extra_a = [
        torch.nn.Parameter(
            DTensor.from_local(torch.ones(3, 2), p[0].device_mesh, p[0].placements, run_check=False)
        )
    ]
    extra_b = [
        torch.nn.Parameter(
            DTensor.from_local(torch.ones(3, 2), q[0].device_mesh, q[0].placements, run_check=False)
        )
    ]
    a = FullyShardedOptimizer(
        torch.optim.AdamW(p, lr=0.01, foreach=True, amsgrad=True),
        model_chunks=[torch.nn.ParameterList(p + extra_a)],
    )
    b = FullyShardedOptimizer(
        torch.optim.AdamW(q, lr=0.01, foreach=True, amsgrad=True),
        model_chunks=[torch.nn.ParameterList(q + extra_b)],
    )
    step = 0

    def both(n=1):
        nonlocal step
        for _ in range(n):
            _set_grads(p, step, **no_scaler)
            _set_grads(q, step, **no_scaler)
            a.step()
            with _generic():
                b.step()
            a.zero_grad()
            b.zero_grad()
            _assert_same(f"invalidation step {step}", a, b, p, q)
            step += 1

    both(3)
    out["start"] = a.fast_steps  # 2: the first step creates the state

    # FSDP2 replaces a local tensor (as load_state_dict(assign=True) does): the prepare plan
    # sees it, that step runs generic, and the fast cache is rebuilt for the next one
    for params in (p, q):
        old = params[0]._local_tensor
        params[0]._local_tensor = old.clone()
    both(1)
    out["after_replace_step"] = a.fast_steps
    both(2)
    out["after_replace"] = a.fast_steps
    assert a.param_groups[0]["params"][0] is p[0]  # transparent: the user's DTensor
    assert a._engines[0].fast._groups[0].params[0] is p[0]._local_tensor

    # add_param_group: the new params have no state yet (generic once), then fast again
    a.add_param_group({"params": extra_a, "lr": 0.02})
    b.add_param_group({"params": extra_b, "lr": 0.02})
    p.extend(extra_a)
    q.extend(extra_b)
    before = a.fast_steps
    both(3)
    out["after_add_group"] = a.fast_steps - before  # 2

    # the state replaced wholesale (the base optimizer's load_state_dict): rebuilt, still exact
    sd_a, sd_b = a.optimizer.state_dict(), b.optimizer.state_dict()
    a.optimizer.load_state_dict(sd_a)
    b.optimizer.load_state_dict(sd_b)
    before = a.fast_steps
    both(2)
    out["after_load"] = a.fast_steps - before  # 2: the new state is complete
    # the cache follows the new state objects (an update into the old ones would not show)
    assert all(
        t is a.state[x]["exp_avg"]._local_tensor
        for x, t in zip(
            a.param_groups[0]["params"], a._engines[0].fast._groups[0].exp_avgs, strict=True
        )
    )

    # amsgrad switched off for a group: rebuilt without max_exp_avg_sq lists
    for opt in (a, b):
        opt.param_groups[1]["amsgrad"] = False
    before = a.fast_steps
    both(2)
    out["after_amsgrad_off"] = a.fast_steps - before
    return out


def test_cache_invalidation(ranks):
    (out,) = ranks(1).run(_rank_invalidation)
    assert out["start"] == 2
    assert out["after_replace_step"] == 2 and out["after_replace"] == 4
    assert out["after_add_group"] == 2
    assert out["after_load"] == 2
    assert out["after_amsgrad_off"] == 2


# ---------------------------------------------------------------------------------------------
# multi-rank training equivalence


def _rank_training(fused):
    """Adam and AdamW (with and without the empty-shard filter) through the wrapper match the
    unsharded reference (test_optimizer's helper); returns the norms and the fast-step count,
    counted through FastAdamStep.step since the helper builds its own wrapper."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from test_optimizer import _train_and_compare

    from mfsdp_optim.optim._engines._fast_step import FastAdamStep

    mesh = get_mesh((dist.get_world_size(),))
    original = FastAdamStep.step
    n = [0]

    def counting(self, *args, **kwargs):
        n[0] += 1
        return original(self, *args, **kwargs)

    out = {}
    FastAdamStep.step = counting  # type: ignore[method-assign]
    try:
        for name in ("Adam", "AdamW"):
            for filt in (False, True):
                n[0] = 0
                norms, _ = _train_and_compare(mesh, name, steps=4, fused=fused, filter_empty=filt)
                out[f"{name}-{filt}"] = (norms, n[0])
    finally:
        FastAdamStep.step = original  # type: ignore[method-assign]
    return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_training_matches_reference_2_ranks(ranks, fused):
    results = ranks(2).run(_rank_training, fused)
    assert results[0] == results[1]
    # 4 steps: the first creates the state on the generic path, the other 3 are fast
    assert all(count == 3 for _, count in results[0].values()), results[0]
