"""FullyShardedOptimizer's step contract on real gloo ranks: dense+expert meshes, overflow
agreement (vs stock torch.amp.GradScaler), grad dtype casts, schedulers, hooks, alias re-binding,
stages and config errors."""

from __future__ import annotations

import copy
import math
import warnings

import torch
from _models import _batch, _model, _shard


def _moe(stripe: int):
    """A dense layer shared by all ranks and the expert of this rank's stripe."""
    gen = torch.Generator().manual_seed(11)
    dense = torch.nn.Linear(6, 5)
    experts = [torch.nn.Linear(5, 2) for _ in range(2)]
    with torch.no_grad():
        for lin in [dense, *experts]:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    ref = torch.nn.ModuleDict(
        {"dense": copy.deepcopy(dense), "experts": torch.nn.ModuleList(copy.deepcopy(experts))}
    )
    model = torch.nn.ModuleDict({"dense": dense, "expert": experts[stripe]})
    return model, ref


def _moe_setup():
    """World 4 as a 2x2 mesh (d0 = expert parallel, d1 = expert data parallel): the dense layer
    is sharded over all 4 ranks, each expert over the 2 ranks of its d0 stripe."""
    from _layouts import get_mesh
    from torch.distributed.fsdp import fully_shard

    stripe = get_mesh((2, 2)).get_coordinate()[0]
    model, ref = _moe(stripe)
    fully_shard(model["dense"], mesh=get_mesh((4,)))
    fully_shard(model["expert"], mesh=get_mesh((2, 2), (1,)))
    return stripe, model, ref


def _moe_loss(model, x):
    return model["expert"](torch.tanh(model["dense"](x))).pow(2).mean()


def _moe_ref_grads(ref, x):
    """The grads FSDP gives: dense averaged over all 4 ranks (both experts' paths), each expert
    averaged over its own 2 ranks (its own path only), hence the factor 2 on expert grads."""
    h = torch.tanh(ref["dense"](x))
    loss = sum(e(h).pow(2).mean() for e in ref["experts"]) / 2
    loss.backward()
    for p in ref["experts"].parameters():
        p.grad.mul_(2)


def _rank_moe():
    from mfsdp_optim.optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    out = {}
    # --- training equivalence on the dense+expert layout, with clipping
    stripe, model, ref = _moe_setup()
    expert_first = list(model["expert"].parameters()) + list(model["dense"].parameters())
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(expert_first, lr=0.01, foreach=True),
        OptimizerConfig(clip_grad=0.5),
        model_chunks=[model],
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    for step in range(3):
        x = _batch(step)
        _moe_loss(model, x).backward()
        ok, norm, _ = opt.step()
        opt.zero_grad()
        _moe_ref_grads(ref, x)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        assert ref_norm > 0.5
        ref_opt.step()
        ref_opt.zero_grad()
        assert ok and math.isclose(norm, ref_norm, rel_tol=1e-5), (norm, ref_norm)
    for name, p in model["dense"].named_parameters():
        torch.testing.assert_close(p.full_tensor(), getattr(ref["dense"], name).detach())
    for name, p in model["expert"].named_parameters():
        torch.testing.assert_close(p.full_tensor(), getattr(ref["experts"][stripe], name).detach())
    out["norm"] = norm

    # --- overflow: NaN planted on rank 0's expert grad, stock scaler vs ours
    def planted(model_, scale_loss):
        scale_loss(_moe_loss(model_, _batch(9))).backward()
        if torch.distributed.get_rank() == 0:
            model_["expert"].weight.grad._local_tensor[0, 0] = float("nan")

    stripe, stock_model, _ = _moe_setup()
    stock_params = list(stock_model["expert"].parameters()) + list(
        stock_model["dense"].parameters()
    )
    stock_opt = torch.optim.Adam(stock_params, lr=0.01)
    stock_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    planted(stock_model, stock_scaler.scale)
    stock_scaler.unscale_(stock_opt)
    out["stock_found_inf"] = bool(
        sum(v.item() for v in stock_scaler._found_inf_per_device(stock_opt).values())
    )

    stripe, model, ref = _moe_setup()
    params = list(model["expert"].parameters()) + list(model["dense"].parameters())
    scaler = DynamicGradScaler(1024.0, hysteresis=1, growth_interval=1)
    opt = FullyShardedOptimizer(
        torch.optim.Adam(params, lr=0.01),
        OptimizerConfig(clip_grad=1.0),
        grad_scaler=scaler,
        model_chunks=[model],
    )
    before = [p._local_tensor.clone() for p in params]
    planted(model, opt.scale_loss)
    ok, norm, zeros = opt.step()
    assert not ok and math.isnan(norm) and zeros is None
    assert all(torch.equal(a, p._local_tensor) for a, p in zip(before, params, strict=True))
    assert len(opt.state) == 0, "a skipped step must not create optimizer state"
    out["ours_found_inf"] = True
    out["scale_after_skip"] = scaler.get_scale()
    # the next, clean step goes through with the backed-off scale and matches the reference
    opt.zero_grad()
    x = _batch(3)
    opt.scale_loss(_moe_loss(model, x)).backward()
    ok, norm, _ = opt.step()
    _moe_ref_grads(ref, x)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    torch.optim.Adam(ref.parameters(), lr=0.01).step()
    assert ok and math.isclose(norm, ref_norm, rel_tol=1e-5), (norm, ref_norm)
    for name, p in model["dense"].named_parameters():
        torch.testing.assert_close(p.full_tensor(), getattr(ref["dense"], name).detach())
    out["scale_after_growth"] = scaler.get_scale()
    out["scaler_state"] = opt.grad_scaler_state_dict()
    return out


def test_dense_expert_training_and_overflow_agreement(ranks):
    results = ranks(4).run(_rank_moe)
    assert len({r["norm"] for r in results}) == 1
    # stock torch.amp.GradScaler reduces found_inf over the FIRST grad's mesh (the expert stripe
    # {0, 1} here, torch/distributed/tensor/_dispatch.py found_inf_reduce_handler): ranks 2 and 3
    # never hear of rank 0's NaN and would step while ranks 0 and 1 skip
    assert [r["stock_found_inf"] for r in results] == [True, True, False, False]
    # ours: one collective over the grad-stats group, so every rank skips and backs off alike
    assert all(r["ours_found_inf"] for r in results)
    assert [r["scale_after_skip"] for r in results] == [512.0] * 4
    assert [r["scale_after_growth"] for r in results] == [1024.0] * 4
    assert all(r["scaler_state"] == results[0]["scaler_state"] for r in results)


def _rank_cast_sched_hooks_rebind():
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import ConstantGradScaler, FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((dist.get_world_size(),))
    # --- bf16 grads of fp32 params, loss scale 8: cast for the base step, restored after
    model = _model(4)
    ref = copy.deepcopy(model)
    _shard(model, mesh)
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        OptimizerConfig(clip_grad=0.05),
        grad_scaler=ConstantGradScaler(8.0),
        model_chunks=[model],
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(2):
        x = _batch(step)
        opt.scale_loss(model(x).pow(2).mean()).backward()
        for p in model.parameters():
            g = p.grad
            p.grad = None
            p.grad_dtype = None
            p.grad = DTensor.from_local(
                g._local_tensor.bfloat16(),
                g.device_mesh,
                g.placements,
                run_check=False,
                shape=g.shape,
                stride=g.stride(),
            )
        ok, norm, _ = opt.step()
        ref(x).pow(2).mean().backward()
        for p in ref.parameters():
            p.grad = p.grad.bfloat16().float()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        ref_opt.step()
        assert ok and math.isclose(norm, ref_norm, rel_tol=1e-5), (norm, ref_norm)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad.dtype == torch.bfloat16, "grad dtype restored"
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.bfloat16(), msg=n)
            torch.testing.assert_close(p.full_tensor(), q.detach(), msg=n)
        opt.zero_grad()
        ref_opt.zero_grad()
        assert all(a.grad is None for g in opt.param_groups for a in g["params"]), "unbound"

    # --- lr scheduler and step hooks
    model = _model(5)
    _shard(model, mesh)
    opt = FullyShardedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model_chunks=[model])
    calls = []
    snap = {}
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", len(a))))

    def post(o, a, k):  # a post hook sees the updated params (e.g. to refresh FP8 weights)
        calls.append(("post", o.last_update_successful))
        snap["w"] = next(model.parameters()).full_tensor()

    opt.register_step_post_hook(post)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an order warning from the scheduler fails the test
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        for step in range(3):
            model(_batch(step)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.125]
    assert calls == [("pre", 1), ("post", True)] * 3
    assert torch.equal(snap["w"], next(model.parameters()).full_tensor())

    # --- state of a DTensor-stepped optimizer is left as it is at wrap time (transparent) and
    #     picked up by the next step; a replaced _local_tensor (FSDP2 lazy init,
    #     load_state_dict(assign=True)) is followed
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(7, 3, generator=gen)
    local = torch.chunk(full, dist.get_world_size())[dist.get_rank()].clone()
    p = torch.nn.Parameter(
        DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    )
    ref_p = torch.nn.Parameter(full.clone())
    base = torch.optim.Adam([p], lr=0.1, foreach=True)
    ref_opt = torch.optim.Adam([ref_p], lr=0.1, foreach=True)
    chunk = torch.nn.ParameterDict({"w": p})

    def grad(step):
        return torch.randn(7, 3, generator=torch.Generator().manual_seed(50 + step))

    def set_grad(step):
        g = grad(step)
        p.grad = DTensor.from_local(
            torch.chunk(g, dist.get_world_size())[dist.get_rank()].clone(),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=g.shape,
            stride=g.stride(),
        )
        ref_p.grad = g

    set_grad(0)
    base.step()  # stock step on the DTensor: state keyed by the DTensor, values DTensors
    ref_opt.step()
    before = {k: v for k, v in base.state[p].items()}
    opt = FullyShardedOptimizer(base, model_chunks=[chunk])
    assert list(base.state) == [p] and base.state[p] == before  # the same objects
    assert all(isinstance(base.state[p][k], DTensor) for k in ("exp_avg", "exp_avg_sq"))
    for step in (1, 2):
        if step == 2:
            old = p._local_tensor
            p._local_tensor = old.clone()  # what FSDP2 does at lazy init
        set_grad(step)
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(p.full_tensor(), ref_p.detach())
    assert list(base.state) == [p] and all(base.state[p][k] is v for k, v in before.items())
    assert base.param_groups[0]["params"][0] is p
    from mfsdp_optim.optim._checkpointing import records_of

    rec = records_of(opt._engines[0])
    assert [r.fqn for r in rec] == ["w"] and rec[0].opt_param is p
    return True


def test_grad_cast_scheduler_hooks_and_rebind(ranks):
    assert ranks(2).run(_rank_cast_sched_hooks_rebind) == [True, True]


def _rank_bad_configs():
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((dist.get_world_size(),))
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            errors[key] = (type(exc).__name__, str(exc))
        else:
            errors[key] = None

    plain = torch.nn.Linear(2, 2)
    capture("plain", lambda: FullyShardedOptimizer(torch.optim.SGD(plain.parameters(), lr=1)))
    model = _model(0)
    _shard(model, mesh)
    other = _model(1)
    _shard(other, mesh)
    capture(
        "missing",
        lambda: FullyShardedOptimizer(
            torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=1),
            model_chunks=[model],
        ),
    )
    capture(
        "collide",
        lambda: FullyShardedOptimizer(
            torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=1),
            model_chunks=[model, other],
        ),
    )
    only0 = dist.new_group([0])
    capture(
        "group",
        lambda: FullyShardedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1),
            OptimizerConfig(grad_stats_group=only0),
            model_chunks=[model],
        ),
    )
    capture("clip", lambda: OptimizerConfig(clip_grad=-1.0))
    capture("norm", lambda: OptimizerConfig(norm_type=0.0))
    opt = FullyShardedOptimizer(torch.optim.SGD(model.parameters(), lr=1), model_chunks=[model])
    capture(
        "state_dict",
        FullyShardedOptimizer(  # stock state_dict() only without the filter
            torch.optim.SGD(model.parameters(), lr=1),
            OptimizerConfig(filter_empty_shards=True),
            model_chunks=[model],
        ).state_dict,
    )
    capture("step_before_prepare", opt.step_with_ready_grads)
    model(_batch(0)).sum().backward()
    found = opt.prepare_grads()
    capture("prepare_twice", opt.prepare_grads)
    capture("step_after_prepare", opt.step)
    norm_prepared = opt.clip_grad_norm(1e-3)
    assert opt.step_with_ready_grads() is True
    capture("step_twice", opt.step_with_ready_grads)
    assert opt.get_grad_norm() <= 1e-3 * (1 + 1e-4), "clip_grad_norm clipped the grads"
    opt.zero_grad(set_to_none=False)
    assert opt.count_zeros() == sum(p.numel() for p in model.parameters())
    # a replicated (non-FSDP) DTensor is fine; a Partial one is refused by the stats layer
    rep = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Replicate()]))
    FullyShardedOptimizer(torch.optim.SGD([rep], lr=1))
    return errors, found, norm_prepared


def test_bad_configs_and_stage_errors(ranks):
    import re

    results = ranks(2).run(_rank_bad_configs)
    errors, found, norm = results[0]
    assert found is False and norm > 1e-3
    expect = {
        "plain": (
            "TypeError",
            r"param_groups\[0\]\['params'\]\[0\] is a Parameter, expected a "
            r"DTensor.*fully_shard",
        ),
        "missing": (
            "ValueError",
            r"6 optimizer params are missing from model_chunks: "
            r"param_groups\[0\]\['params'\]\[6\] \(shape \(5, 6\)",
        ),
        "collide": ("ValueError", r"colliding parameter FQNs: '0\.bias' \(chunks \[0, 1\]\)"),
        "group": (
            "ValueError",
            r"grad_stats_group misses ranks \[1\] that hold shards of "
            r"'0\.weight'",
        ),
        "clip": ("ValueError", r"clip_grad must be a finite number >= 0"),
        "norm": ("ValueError", r"norm_type must be > 0"),
        "state_dict": ("NotImplementedError", r"sharded_state_dict\(\)"),
        "step_before_prepare": ("RuntimeError", r"stage READY: call prepare_grads\(\) first"),
        "prepare_twice": ("RuntimeError", r"prepare_grads\(\) was already called"),
        "step_after_prepare": ("RuntimeError", r"step\(\) called after prepare_grads\(\)"),
        "step_twice": ("RuntimeError", r"stage STEPPED: the grads were already used"),
    }
    for key, (kind, pattern) in expect.items():
        for r, (errs, _, _) in enumerate(results):
            got = errs[key]
            assert got is not None, f"{key}: no error on rank {r}"
            assert got[0] == kind and re.search(pattern, got[1]), (key, r, got)


def _rank_add_param_group():
    import torch.distributed as dist
    from _layouts import get_mesh

    from mfsdp_optim.optim import FullyShardedOptimizer

    mesh = get_mesh((dist.get_world_size(),))
    first, second, outsider = _model(0), _model(1), _model(2)
    ref_first, ref_second = _model(0), _model(1)
    for m in (first, second, outsider):
        _shard(m, mesh)
    errors = {}

    def refused(key, opt, group):
        """add_param_group must raise and leave groups, state and names as they were."""
        groups_before = [list(g["params"]) for g in opt.param_groups]
        names_before = [s.fqn for s in opt._engines[0].table.slots]
        try:
            opt.add_param_group(group)
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            errors[key] = (type(exc).__name__, str(exc))
        else:
            errors[key] = None
        assert [list(g["params"]) for g in opt.param_groups] == groups_before, key
        assert [s.fqn for s in opt._engines[0].table.slots] == names_before, key

    # without model_chunks, params are named by position over all groups: no collisions
    opt = FullyShardedOptimizer(torch.optim.Adam(first.parameters(), lr=1e-2))
    opt.add_param_group({"params": list(second.parameters()), "lr": 2e-2})
    names = [s.fqn for s in opt._engines[0].table.slots]
    refused("again", opt, {"params": [next(second.parameters())]})
    refused("plain", opt, {"params": [torch.nn.Parameter(torch.ones(2))]})
    # with model_chunks, a param from outside them is refused before anything changes
    chunked = FullyShardedOptimizer(
        torch.optim.Adam(first.parameters(), lr=1e-2), model_chunks=[first]
    )
    refused("outside", chunked, {"params": list(outsider.parameters())})

    # the optimizer still trains both groups like the plain one
    ref = torch.optim.Adam(ref_first.parameters(), lr=1e-2)
    ref.add_param_group({"params": list(ref_second.parameters()), "lr": 2e-2})
    for step in range(3):
        for models, o in (((first, second), opt), ((ref_first, ref_second), ref)):
            o.zero_grad()
            # every rank sees the same batch, so FSDP's averaged grads equal the plain ones
            sum(m(_batch(step)).pow(2).mean() for m in models).backward()
            o.step()
    same = all(
        torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
        for p, q in zip(
            [*first.parameters(), *second.parameters()],
            [*ref_first.parameters(), *ref_second.parameters()],
            strict=True,
        )
    )
    return names, errors, same


def test_add_param_group_names_and_refusals(ranks):
    import re

    for names, errors, same in ranks(2).run(_rank_add_param_group):
        assert len(set(names)) == len(names) == 12, names
        assert names[6] == "param_groups.1.params.0", names
        expect = {
            # the base optimizer holds the DTensors themselves: torch's own check refuses it
            "again": ("ValueError", r"appear in more than one parameter group"),
            "plain": ("TypeError", r"param_groups\[2\]\['params'\]\[0\] is a Parameter"),
            "outside": ("ValueError", r"missing from model_chunks: param_groups\[1\]"),
        }
        for key, (kind, pattern) in expect.items():
            got = errors[key]
            assert got is not None and got[0] == kind and re.search(pattern, got[1]), (key, got)
        assert same, "training after refused add_param_group calls differs from torch"


def _rank_step_hooks():
    """The wrapper's step under torch's step-hook contract, against a stock optimizer run the
    same way: the order the hooks fire in, what they are given, the grad mode they see, a pre
    hook's new arguments, a bad return, a subclass's own step, the profiler's range."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from mfsdp_optim.optim import FullyShardedOptimizer

    mesh = get_mesh((dist.get_world_size(),))

    class Sub(FullyShardedOptimizer):
        def step(self, closure=None):  # its own step: torch's wrapper fires the hooks
            return super().step(closure)

    def make(kind):
        model = _model(5)
        if kind == "stock":
            return model, torch.optim.SGD(model.parameters(), lr=0.1)
        _shard(model, mesh)
        cls = Sub if kind == "subclass" else FullyShardedOptimizer
        return model, cls(torch.optim.SGD(model.parameters(), lr=0.1), model_chunks=[model])

    def trace(kind):
        model, opt = make(kind)
        log = []

        def hook(name):
            def fn(o, args, kwargs):
                log.append((name, o is opt, args[0] is opt, len(args), sorted(kwargs)))
                log.append(("grad mode", torch.is_grad_enabled()))
                if name == "own pre" and len(log) > 9:  # from the second step on: a closure
                    return args, {"closure": lambda: log.append(("closure", True))}
                return None

            return fn

        opt._optimizer_step_code = lambda: log.append(("profiler probe", True))
        handles = [
            register_optimizer_step_pre_hook(hook("global pre")),
            register_optimizer_step_post_hook(hook("global post")),
            opt.register_step_pre_hook(hook("own pre")),
            opt.register_step_post_hook(hook("own post")),
        ]
        try:
            for step in range(2):
                model(_batch(step)).sum().backward()
                opt.step()
                log.append(("after", torch.is_grad_enabled()))
                opt.zero_grad()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.step()
            ranges = {e.key for e in prof.key_averages() if e.key.startswith("Optimizer.step#")}
            opt.register_step_pre_hook(lambda *a: 5)
            try:
                opt.step()
                bad = None
            except RuntimeError as exc:
                bad = "new_args, new_kwargs" in str(exc)
        finally:
            for h in handles:
                h.remove()
        return log, ranges, bad, type(opt).__name__

    out = {kind: trace(kind) for kind in ("stock", "wrapper", "subclass")}
    return {k: (log, ranges, bad, name) for k, (log, ranges, bad, name) in out.items()}


def test_step_hooks_fire_as_torch_fires_them(ranks):
    (out,) = ranks(1).run(_rank_step_hooks)
    stock_log, stock_ranges, stock_bad, _ = out["stock"]
    assert stock_ranges == {"Optimizer.step#SGD.step"} and stock_bad is True
    assert ("closure", True) in stock_log
    for kind in ("wrapper", "subclass"):
        log, ranges, bad, name = out[kind]
        assert log == stock_log, (kind, log, stock_log)
        # (the base optimizer's own step, run inside, has its range too)
        assert f"Optimizer.step#{name}.step" in ranges, (kind, ranges)
        assert bad is True, kind
