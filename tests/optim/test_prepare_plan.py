"""The wrapper's steady-state prepare (``_prepare.PreparePlan``): replayed only while nothing
the full prepare loop checks has changed, and the same results either way.

One world-size-1 gloo rank. The grads reuse one spec object per param from step to step, as
FSDP2 hands them out, so the plan can replay; a scripted sequence then changes one thing at a
time (a missing grad, a bf16 grad, a fresh spec, a replaced local tensor, a new param group) and
checks which steps replayed. Reference: the same torch optimizer stepping plain local tensors
with the same grads; params must be bitwise equal after every step (no clipping, so the wrapper
and the reference run the same kernels on the same values).
"""

from __future__ import annotations

import pytest
import torch

SHAPES = [(6, 4), (3,), (5, 2), (0, 4), (7,)]

# step -> what changes at that step; "replay": whether the prepare should replay the plan
SCRIPT = [
    ("plain", False),  # first step: the full loop records the plan
    ("plain", True),
    ("no-grad-2", False),  # param 2 has no grad: full loop, no plan recorded
    ("plain", False),  # full loop again, records the plan
    ("plain", True),
    ("bf16-0", False),  # a cast: full loop, no plan
    ("plain", False),
    ("fresh-spec-1", False),  # a new spec object: full loop (validates it), records the plan
    ("plain", True),  # the new spec is kept from here on
    ("swap-local-3", False),  # FSDP2 replaced a local tensor: full loop, records the plan
    ("plain", True),  # over the new local tensor (the base optimizer holds the DTensor)
    ("plain", True),
    ("new-group", False),  # add_param_group: the slot table changed
    ("plain", True),
]


def _rank_script(mode: str):
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((1,))
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES + [(4, 2)]]
    params = [
        torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False))
        for t in init[:-1]
    ]
    extra = torch.nn.Parameter(
        DTensor.from_local(init[-1].clone(), mesh, [Shard(0)], run_check=False)
    )
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=0.01, weight_decay=0.1, **{mode: True})
    chunk = torch.nn.Module()
    for i, p in enumerate(params + [extra]):
        chunk.register_parameter(f"p{i}", p)
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(params, **kw), OptimizerConfig(), model_chunks=[chunk]
    )
    ref_opt = torch.optim.AdamW(ref[:-1], **kw)
    specs = [None] * len(init)
    replayed = []
    for step, (event, _) in enumerate(SCRIPT):
        if event == "new-group":
            opt.add_param_group({"params": [extra]})
            ref_opt.add_param_group({"params": [ref[-1]]})
        if event == "swap-local-3":  # what FSDP2's lazy init or load_state_dict(assign) does
            params[3]._local_tensor = params[3]._local_tensor.clone()
        if event == "fresh-spec-1":
            specs[1] = None
        g_gen = torch.Generator().manual_seed(100 + step)
        live = params + (
            [extra] if opt.param_groups[-1]["params"] and len(opt.param_groups) == 2 else []
        )
        for i, p in enumerate(live):
            g = torch.randn(p.shape, generator=g_gen)
            if event == "no-grad-2" and i == 2:
                p.grad, ref[i].grad = None, None
                continue
            if event == "bf16-0" and i == 0:
                g = g.to(torch.bfloat16)
                p.grad_dtype = None
            if specs[i] is None:
                p.grad = DTensor.from_local(g, mesh, [Shard(0)], run_check=False)
                specs[i] = p.grad._spec
            elif g.dtype != torch.float32:
                p.grad = DTensor.from_local(g, mesh, [Shard(0)], run_check=False)
            else:
                p.grad = DTensor(g, specs[i], requires_grad=False)
            ref[i].grad = g.to(torch.float32)
        before = opt.prepare_replays
        ok, _, _ = opt.step()
        assert ok
        replayed.append(opt.prepare_replays - before)
        ref_opt.step()
        for i, p in enumerate(live):
            assert torch.equal(p._local_tensor, ref[i].detach()), (mode, step, event, i)
            if p.grad is not None:
                assert p.grad._local_tensor.dtype == (
                    torch.bfloat16 if event == "bf16-0" and i == 0 else torch.float32
                )
        opt.zero_grad()
        ref_opt.zero_grad()
    return replayed, opt.fast_steps


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_plan_replays_only_when_nothing_changed(ranks, mode):
    ((replayed, fast_steps),) = ranks(1).run(_rank_script, mode)
    assert replayed == [int(r) for _, r in SCRIPT], replayed
    assert fast_steps > 0  # the fast step took the replayed lists too
