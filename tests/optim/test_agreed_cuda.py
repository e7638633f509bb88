"""Agreed hyperparameters on CUDA: a device tensor's digest without a sync, the captured step.

One GPU (NCCL world of one): a CUDA tensor ``lr``, changed in place between steps, is digested
on the device under ``torch.cuda.set_sync_debug_mode("error")``, and its digest follows the
change; the captured step reads the digest buffer at every replay (a NaN written into it makes
the replayed verdict fail: the update is skipped) and a changed lr reaches that buffer before
the replay, still without a sync. Two GPUs (two spawned ranks on NCCL, skipped with fewer):
rank 1 changes its lr between replays, and both ranks' replayed step is skipped with a NaN
norm; a CUDA tensor lr that differs raises ``HyperparameterMismatchError`` on both ranks with
``host_sync=True``. Skipped without a CUDA device (``scripts/gpu_check.sh`` runs them).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, nullcontext

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

SHAPES = [(64, 32), (33,), (17, 5)]


@contextmanager
def _world(directory, rank=0, world=1):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(str(directory), "store"), world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    try:
        dist.all_reduce(torch.zeros(1, device="cuda"))  # the communicator, outside any check
        yield init_device_mesh("cuda", (world,))
    finally:
        dist.destroy_process_group()


def _params(mesh, seed=0):
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.nn.Parameter(
            DTensor.from_local(torch.randn(s, device="cuda", generator=gen), mesh, [Shard(0)])
        )
        for s in SHAPES
    ]


def _grads(params, mesh, step):
    """Each param's grad for ``step``, written into the same tensors after the first step (the
    captured step replays only while the grads stay where they are)."""
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator(device="cuda").manual_seed(100 + step)
    for p in params:
        g = torch.randn(p._local_tensor.shape, device="cuda", generator=gen)
        if p.grad is None:
            p.grad = DTensor.from_local(g, mesh, [Shard(0)])
        else:
            p.grad._local_tensor.copy_(g)


@contextmanager
def _no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_cuda_tensor_lr_is_digested_on_the_device_without_a_sync(tmp_path):
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    with _world(tmp_path) as mesh:
        params = _params(mesh)
        lr = torch.tensor(0.01, device="cuda")
        w = FullyShardedOptimizer(  # torch's fused kernel: it takes a device lr as it is
            torch.optim.AdamW(params, lr=lr, fused=True),
            OptimizerConfig(clip_grad=0.5, host_sync=False, triton_adam_step=False),
            grad_scaler=DynamicGradScaler(2.0**4),
        )
        digests = []
        for step in range(4):
            _grads(params, mesh, step)
            if step == 2:
                lr.fill_(0.02)  # in place, as a scheduler of a tensor lr does
            with _no_sync() if step >= 1 else nullcontext():  # (the first creates the state)
                ok, norm, _ = w.step()
            digests.append(w._agreement.values(None).tolist())
            assert bool(ok) and torch.isfinite(norm), step
        assert digests[0] == digests[1] != digests[2] == digests[3], digests
        assert digests[0][0] == digests[2][0]  # the host part: dtype and shape, not values


def test_the_captured_step_reads_the_digest_a_changed_lr_updates(tmp_path):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    with _world(tmp_path) as mesh:
        params = _params(mesh)
        w = FullyShardedOptimizer(
            torch.optim.AdamW(params, lr=1e-2, fused=True),
            OptimizerConfig(clip_grad=0.5, host_sync=False, cuda_graph=True),
        )
        graph = w._captured.graph
        results = []
        for step in range(7):
            _grads(params, mesh, step)
            before = [p._local_tensor.clone() for p in params]
            if step == 3:  # the buffer the row reads: NaN differs from itself, so the verdict fails
                w._agreement.buffer[0] = float("nan")
            if step == 5:  # a changed lr: a new digest uploaded before the replay, over the NaN
                w.param_groups[0]["lr"] = 5e-3
            with _no_sync() if step >= 2 else nullcontext():  # (the first steps compile)
                ok, norm, _ = w.step()
            torch.cuda.synchronize()
            moved = not all(
                torch.equal(a, p._local_tensor) for a, p in zip(before, params, strict=True)
            )
            results.append((bool(ok), bool(torch.isfinite(norm)), moved))
        assert graph.captures == 1 and graph.disabled is None, (graph.captures, graph.disabled)
        assert graph.replays == 6, graph.replays
        assert results[3] == results[4] == (False, False, False), results  # replayed, skipped
        assert results[5] == results[6] == (True, True, True), results


# ---------------------------------------------------------------------------------------------
# two GPUs: ranks that differ


def _two_ranks(rank, tmp, kind):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    out = []
    with _world(tmp, rank, 2) as mesh:
        params = _params(mesh, seed=rank)
        if kind == "captured":
            w = FullyShardedOptimizer(
                torch.optim.AdamW(params, lr=1e-2, fused=True),
                OptimizerConfig(clip_grad=0.5, host_sync=False, cuda_graph=True),
            )
            for step in range(5):
                _grads(params, mesh, step)
                if rank == 1:
                    w.param_groups[0]["lr"] = 2e-2 if step == 3 else 1e-2
                ok, norm, _ = w.step()
                out.append((bool(ok), float(norm)))
            out.append((w._captured.graph.replays, w._captured.graph.captures))
        else:
            lr = torch.tensor(0.02 if rank == 1 else 0.01, device="cuda")
            w = FullyShardedOptimizer(
                torch.optim.AdamW(params, lr=lr, fused=True),
                OptimizerConfig(triton_adam_step=False),
            )
            _grads(params, mesh, 0)
            try:
                w.step()
                out.append(None)
            except Exception as exc:  # both ranks: the same error
                out.append((type(exc).__name__, str(exc)))
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.mark.parametrize("kind", ["captured", "tensor_lr"])
def test_two_gpus_that_differ(tmp_path, kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import torch.multiprocessing as mp

    mp.start_processes(_two_ranks, args=(str(tmp_path), kind), nprocs=2, start_method="spawn")
    out = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            out.append(json.load(f))
    if kind == "captured":
        for steps in out:
            *results, (replays, captures) = steps
            assert captures == 1 and replays == 4, steps
            assert [r[0] for r in results] == [True, True, True, False, True], steps
            assert results[3][1] != results[3][1], steps  # NaN
        return
    for ((name, message),) in out:
        assert name == "HyperparameterMismatchError", message
        assert "AdamW param_groups[0]['lr']: tensor(0.009999999776482582" in message, message
        assert "device=cuda) on ranks [0]" in message, message
