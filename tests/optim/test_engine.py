"""The Engine: one base optimizer's caches under one validity rule and one ``invalidate()``.

One rank (a world of one): after steady steps every cache is built (the prepare plan, the fast
step's lists); ``invalidate()`` drops them all at once; the next step rebuilds them and the
trajectory equals the same optimizer stepping plain tensors, bit for bit (fused AdamW: the same
kernels on the same values).
"""

from __future__ import annotations

import pytest
import torch


def _rank_invalidate():
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer

    mesh = get_mesh((dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen)]
    params = [
        torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False))
        for t in init
    ]
    plain = [torch.nn.Parameter(t.clone()) for t in init]
    opt = FullyShardedOptimizer(torch.optim.AdamW(params, lr=0.01, fused=True))
    ref = torch.optim.AdamW(plain, lr=0.01, fused=True)
    engine = opt._engines[0]
    built = []
    for step in range(6):
        grads = [torch.randn(t.shape, generator=gen) for t in init]
        for p, q, g in zip(params, plain, grads, strict=True):
            p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
            q.grad = g.clone()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        built.append((engine.preparer.plan is not None, engine.fast.token is not None))
        if step == 3:
            engine.invalidate()
            built.append((engine.preparer.plan is not None, engine.fast.token is not None))
    same = all(torch.equal(p._local_tensor, q.detach()) for p, q in zip(params, plain, strict=True))
    return built, same, opt.fast_steps


def test_invalidate_drops_every_cache_and_the_next_step_rebuilds(ranks):
    [(built, same, fast_steps)] = ranks(1).run(_rank_invalidate)
    assert built[1:4] == [(True, True)] * 3, built  # steady: plan and fast lists kept
    assert built[4] == (False, False), built  # invalidate(): both gone at once
    assert built[5:] == [(True, True)] * 2, built  # rebuilt by the next step
    assert fast_steps == 5  # the first step creates the state through the base step
    assert same, "the trajectory left stock fused AdamW's"


def _rank_clear_all():
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer
    from mfsdp_optim.stats import _buckets

    mesh = get_mesh((dist.get_world_size(),))
    p = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = FullyShardedOptimizer(torch.optim.SGD([p], lr=0.1))
    p.grad = DTensor.from_local(torch.full((4, 2), 2.0), mesh, [Shard(0)])
    norm_before = opt.step()[1]
    filled = bool(_buckets._LAYOUT_BY_SPEC)
    opt.invalidate_caches()
    emptied = not _buckets._LAYOUT_BY_SPEC and not _buckets._LAST_PARTS
    norm_after = opt.step()[1]
    return filled, emptied, norm_before, norm_after, p._local_tensor.clone()


def test_invalidate_caches_also_drops_the_stats_layer_caches(ranks):
    [(filled, emptied, before, after, local)] = ranks(1).run(_rank_clear_all)
    assert filled and emptied
    assert before == after == pytest.approx(32**0.5)  # ||2 * ones(4, 2)||, again after the clear
    assert torch.equal(local, torch.full((4, 2), 1.0 - 2 * 0.1 * 2.0))


def _rank_late_bad_value():
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer

    mesh = get_mesh((dist.get_world_size(),))
    p = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = FullyShardedOptimizer(torch.optim.AdamW([p], lr=0.1, betas=[0.9, 0.99]))
    out = []
    for bad in ("lr", "betas"):
        for _ in range(3):  # steady: the check of unchanged values is skipped
            p.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])
            opt.step()
        group = opt.param_groups[0]
        if bad == "lr":
            group["lr"] = float("nan")
        else:
            group["betas"][1] = 1.5  # a list changed in place: still seen
        before = p._local_tensor.clone()
        try:
            opt.step()
            out.append(None)
        except ValueError as exc:
            out.append((str(exc), torch.equal(before, p._local_tensor)))
        group["lr"], group["betas"] = 0.1, [0.9, 0.99]
        opt.zero_grad()
    return out


def test_a_value_changed_after_steady_steps_is_still_checked(ranks):
    [out] = ranks(1).run(_rank_late_bad_value)
    (lr_msg, lr_kept), (betas_msg, betas_kept) = out
    assert "param_groups[0]['lr']" in lr_msg and lr_kept
    assert "param_groups[0]['betas'][1]" in betas_msg and betas_kept
