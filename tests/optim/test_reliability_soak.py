"""Soak: FullyShardedOptimizer + DynamicGradScaler on 4 gloo ranks with HSDP replicas (2x2 mesh
("replicate", "shard"), placements (Replicate(), Shard(0))), NaN/inf injected into ONE rank's
local grad at random steps (replica ranks included).

Checks: every rank agrees on every skip and the skips are exactly the injected steps; the
replicas' params stay bitwise identical (checked every 100 steps and at the end); the loss-scale
trajectory equals a single-process DynamicGradScaler fed the same injections.

CI runs 300 steps; ``MFSDP_SOAK_STEPS=1000`` runs the full soak (figures in docs/reliability.md).
"""

from __future__ import annotations

import os
import random
import time

import torch

STEPS = int(os.environ.get("MFSDP_SOAK_STEPS", "300"))
SHAPES = [(16, 8), (16,), (5, 3), (3,)]  # uneven; (3,) is empty on shard coordinate 1
SCALER = dict(
    initial_scale=2.0**12, growth_interval=8, hysteresis=2, backoff_factor=0.5, min_scale=1.0
)
P_INJECT = 0.08


def schedule(steps: int, seed: int = 1234) -> dict[int, tuple[int, str, int]]:
    """step -> (rank, "nan" | "inf", element): the same on every rank and in the pytest process."""
    rng = random.Random(seed)
    out = {}
    for t in range(steps):
        if rng.random() < P_INJECT:
            out[t] = (rng.randrange(4), rng.choice(["nan", "inf", "-inf"]), rng.randrange(64))
    return out


def _soak(steps: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mfsdp_optim.optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    coord = mesh.get_coordinate()[1]
    placements = (Replicate(), Shard(0))

    def local_of(full):
        return (
            torch.chunk(full, 2, dim=0)[coord]
            if coord < len(torch.chunk(full, 2, dim=0))
            else full[0:0]
        )

    def dtensor(full):
        return DTensor.from_local(
            local_of(full).clone(),
            mesh,
            placements,
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )

    gen = torch.Generator().manual_seed(7)
    model = torch.nn.Module()
    for i, shape in enumerate(SHAPES):
        model.register_parameter(
            f"p{i}", torch.nn.Parameter(dtensor(torch.randn(shape, generator=gen)))
        )
    params = list(model.parameters())
    base = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    scaler = DynamicGradScaler(**SCALER)
    opt = FullyShardedOptimizer(
        base, OptimizerConfig(clip_grad=1.0), grad_scaler=scaler, model_chunks=[model]
    )
    plan = schedule(steps)
    rep_group = mesh.get_group("replicate")

    def replicas_identical() -> bool:
        ok = True
        for p in params:
            local = p._local_tensor.detach().contiguous()
            got = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(got, local, group=rep_group)
            ok &= bool(torch.equal(got[0].view(torch.int32), got[1].view(torch.int32)))
        return ok

    skipped, scales, checks = [], [], []
    t0 = time.perf_counter()
    for t in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100_000 + t)
        for p in params:
            full = torch.randn(p.shape, generator=g) * 1e-2 * scaler.get_scale()  # scaled grad
            p.grad = dtensor(full)
        if t in plan and plan[t][0] == rank:
            _, kind, element = plan[t]
            local = params[0].grad._local_tensor.view(-1)
            local[element % local.numel()] = float(kind)
        ok, norm, _ = opt.step()
        if not ok:
            skipped.append(t)
        scales.append(scaler.get_scale())
        if (t + 1) % 100 == 0:
            checks.append(replicas_identical())
    elapsed = time.perf_counter() - t0
    checks.append(replicas_identical())
    finite = all(bool(torch.isfinite(p._local_tensor).all()) for p in params)
    return skipped, scales, checks, finite, elapsed


def simulate(steps: int):
    from mfsdp_optim.optim import DynamicGradScaler

    plan = schedule(steps)
    s = DynamicGradScaler(**SCALER)
    scales = []
    for t in range(steps):
        s.update(t in plan)
        scales.append(s.get_scale())
    return sorted(plan), scales


def test_soak_hsdp_nan_injection(ranks):
    out = ranks(4).run(_soak, STEPS, timeout=600)
    want_skips, want_scales = simulate(STEPS)
    plan = schedule(STEPS)
    assert len(want_skips) >= STEPS // 25, "too few injections to mean anything"
    assert {r for r, _, _ in plan.values()} == {0, 1, 2, 3}, "some rank never got a NaN"
    assert len(set(want_scales)) > 3, "the scale never moved"
    for rank, (skipped, scales, checks, finite, _elapsed) in enumerate(out):
        assert skipped == want_skips, f"rank {rank} skipped {skipped}, injected {want_skips}"
        assert scales == want_scales, f"rank {rank}: scale trajectory differs from simulation"
        assert all(checks) and len(checks) == STEPS // 100 + 1, f"replicas diverged: {checks}"
        assert finite, f"rank {rank} params are not finite"
    print(
        f"soak: {STEPS} steps, {len(want_skips)} injected/skipped, scale range "
        f"[{min(want_scales):g}, {max(want_scales):g}], {max(o[4] for o in out):.1f}s on the "
        "slowest rank"
    )
