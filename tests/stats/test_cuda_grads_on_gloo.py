"""CUDA grads with a gloo grad-stats group: the row each rank sends is this step's.

gloo's collectives run on the host, so each rank's statistics row (made on the GPU) is copied to
the host first. A ``.to("cpu", non_blocking=True)`` returns a pinned tensor before that copy has
run; the all-gather then sent whatever the recycled pinned block held (an earlier row): a
one-rank overflow was not seen by the others, and norms were stale. It showed where the stream
was behind the host (the docs' examples under the rank pool on a GPU machine: ``fully_shard``
without a mesh puts a gloo rank's params on CUDA). Here a spin kernel keeps the stream about
0.1 s behind before each call, which makes that race certain; the CPU case runs the same checks
everywhere.
"""

from __future__ import annotations

import math

import pytest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _mesh(device: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return init_device_mesh(device, (dist.get_world_size(),))


def _behind(device: str) -> None:
    """On CUDA: the stream about 0.1 s behind the host from here on."""
    import torch

    if device == "cuda":
        torch.cuda._sleep(200_000_000)


def _rank_stats_each_step(device):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import grad_stats

    rank = dist.get_rank()
    mesh = _mesh(device)
    out = []
    for step, value in enumerate((1.0, 3.0, 5.0)):
        local = torch.full((4,), value * (rank + 1), device=device)
        if step == 2 and rank == 0:
            local[0] = float("inf")
        grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        _behind(device)
        stats = grad_stats([grad], count_zeros=True)
        out.append((float(stats.total_norm), bool(stats.found_inf), int(stats.num_zeros)))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_each_step_gathers_its_own_rows(ranks, device):
    for got in ranks(2).run(_rank_stats_each_step, device, timeout=120.0):
        for value, (norm, found_inf, zeros) in zip((1.0, 3.0), got[:2], strict=True):
            want = math.sqrt(4 * value**2 + 4 * (2 * value) ** 2)  # ranks 0 and 1, 4 each
            assert norm == pytest.approx(want, rel=1e-6) and not found_inf and zeros == 0, got
        norm, found_inf, _ = got[2]
        assert found_inf and math.isinf(norm), got  # rank 0's inf, seen by every rank


def _rank_overflow_on_one_rank(device):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=_mesh(device))
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        OptimizerConfig(clip_grad=1.0),
        grad_scaler=DynamicGradScaler(initial_scale=2.0**16, hysteresis=1),
        model_chunks=[model],
    )
    oks = []
    for step in range(3):
        torch.manual_seed(100 + step)
        opt.scale_loss(model(torch.randn(2, 4, device=device)).sum()).backward()
        if step == 2 and dist.get_rank() == 0:
            model.weight.grad._local_tensor[0, 0] = float("inf")
        _behind(device)
        ok, norm, _ = opt.step()
        opt.zero_grad()
        oks.append((bool(ok), math.isfinite(norm)))
    return oks, float(opt.get_loss_scale())


@pytest.mark.parametrize("device", DEVICES)
def test_an_overflow_on_one_rank_skips_on_every_rank(ranks, device):
    """The scenario of docs/migrating.md ("From torch.amp.GradScaler"), the stream behind."""
    for oks, scale in ranks(2).run(_rank_overflow_on_one_rank, device, timeout=120.0):
        assert oks == [(True, True), (True, True), (False, False)], oks
        assert scale == 2.0**15
