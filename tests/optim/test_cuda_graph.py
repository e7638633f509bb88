"""The captured step on a CUDA device (``OptimizerConfig(cuda_graph=True)``), world size 1 on NCCL.

Two wrappers over identical params train side by side on the same grads: one captured, one
eager (``host_sync=False``), with clipping, a DynamicGradScaler, an inf planted at one step
(skipped on the device, the scale backs off) and an lr schedule that changes the lr at every
step (read by the replay from device memory). The grads are written into the same tensors each
step (what FSDP2 does after ``zero_grad(set_to_none=False)``), except at one step where the
captured wrapper gets a new grad object (re-captured). After every step params, optimizer state,
step counters, scaler state and the returned values must be equal bit for bit. Every step after
the first capture runs under ``torch.cuda.set_sync_debug_mode("error")``, the re-capture
included. Skipped without a CUDA device (``scripts/gpu_check.sh`` runs them).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

SHAPES = [(64, 32), (33,), (17, 5), (1, 4), (2048,)]
STEPS = 9
INF_STEP = 3
MOVE_STEP = 6


@contextmanager
def _nccl_world_of_one(tmp_path, backend="nccl"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor(local, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


@contextmanager
def _no_sync(on: bool):
    if on:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _check_same(step, wc, pc, we, pe):
    for i, (a, b) in enumerate(zip(pc, pe, strict=True)):
        assert torch.equal(_local(a), _local(b)), (step, "param", i)
        sa, sb = wc.state[a], we.state[b]
        assert set(sa) == set(sb), step
        for k in sa:
            assert torch.equal(_local(sa[k]), _local(sb[k])), (step, k, i)
    assert wc.grad_scaler.state_dict() == we.grad_scaler.state_dict(), step


def _prime_stats_kernel():
    """Launch the stats kernel's variant once: its first launch sizes its grid before it has
    learned its occupancy, so a norm summed over another partition would round differently at
    whichever wrapper's step came first (not a difference of the captured step)."""
    from mfsdp_optim.stats import _fused

    x = [torch.ones(4096, device="cuda")]
    _fused.shard_contribution(x, norm_type=2.0, replication=1, canonical=True, count_zeros=True)


@pytest.mark.parametrize("variant", ["triton", "torch"])
def test_captured_matches_eager_bit_for_bit(tmp_path, variant):
    """Capture, replays after lr changes, a skip under a planted inf with the scaler backing
    off, a re-capture after a moved grad: bit for bit the eager trajectory, no sync."""
    import torch.distributed as dist

    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    triton = variant == "triton"
    if triton and not TritonAdam.available():
        pytest.skip("needs Triton")
    # torch's fused kernel reads a tensor lr as float32: float32-exact lrs there; the Triton
    # kernel reads the float64 lr from its table: any lr
    lr, decay = (1e-2, 0.9) if triton else (2.0**-6, 0.5)
    with _nccl_world_of_one(tmp_path) as mesh:
        dist.all_reduce(torch.zeros(1, device="cuda"))  # the communicator, outside the check
        _prime_stats_kernel()
        gen = torch.Generator(device="cuda").manual_seed(0)
        init = [torch.randn(s, device="cuda", generator=gen) for s in SHAPES]
        pairs = []
        for cuda_graph in (True, False):
            ps = [torch.nn.Parameter(_dtensor(t.clone(), mesh)) for t in init]
            w = FullyShardedOptimizer(
                torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, fused=True),
                OptimizerConfig(
                    clip_grad=0.5,
                    log_num_zeros_in_grad=True,
                    host_sync=False,
                    triton_adam_step=triton,
                    cuda_graph=cuda_graph,
                ),
                grad_scaler=DynamicGradScaler(2.0**10, growth_interval=2, hysteresis=1),
            )
            sched = torch.optim.lr_scheduler.LambdaLR(w, lambda s: decay ** (s % 4))
            pairs.append((w, ps, sched))
        (wc, pc, sc), (we, pe, se) = pairs
        kept_c, kept_e = [], []  # every step's returned tensors, read at the end
        for step in range(STEPS):
            grads = [torch.randn(s, device="cuda", generator=gen) * 2.0**10 for s in SHAPES]
            if step == INF_STEP:
                grads[1].view(-1)[0] = float("inf")
            with _no_sync(step > 0):
                for ps in (pc, pe):
                    for j, (p, g) in enumerate(zip(ps, grads, strict=True)):
                        moved = ps is pc and step == MOVE_STEP and j == 0
                        if p.grad is None or moved:
                            p.grad = _dtensor(g.clone(), mesh)
                        else:
                            p.grad._local_tensor.copy_(g)
                rc, re_ = wc.step(), we.step()
                kept_c.append(rc)
                kept_e.append(re_)
                for w, s in ((wc, sc), (we, se)):
                    w.zero_grad(set_to_none=False)
                    s.step()
            _check_same(step, wc, pc, we, pe)
            graph = wc._captured.graph
            assert graph.disabled is None, graph.disabled
            assert graph.captures == (1 if step < MOVE_STEP else 2), (step, graph.captures)
        for step, (a, b) in enumerate(zip(kept_c, kept_e, strict=True)):
            assert bool(a[0]) == bool(b[0]) == (step != INF_STEP), step
            assert torch.equal(a[1], b[1]) or (a[1].isnan() and b[1].isnan()), step
            assert torch.equal(a[2], b[2]), step
        assert len({float(r[1]) for r in kept_c}) > 2  # the returned tensors are each step's
        assert graph.replays == STEPS - 1 - MOVE_STEP
        assert wc.fast_steps == we.fast_steps == STEPS
        if triton:  # the warm-ups and the replays took the Triton update
            assert wc._engines[0].triton.launches == we._engines[0].triton.launches == STEPS


def test_replay_reads_the_new_lr(tmp_path):
    """The replay after an lr change steps with the new lr: a step with lr 0 leaves the params
    (AdamW's decay included) as they were; the next, with the lr back, moves them."""
    import torch.distributed as dist

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    with _nccl_world_of_one(tmp_path) as mesh:
        dist.all_reduce(torch.zeros(1, device="cuda"))
        ps = [torch.nn.Parameter(_dtensor(torch.randn(s, device="cuda"), mesh)) for s in SHAPES]
        w = FullyShardedOptimizer(
            torch.optim.AdamW(ps, lr=1e-2, fused=True),
            OptimizerConfig(host_sync=False, cuda_graph=True),
        )
        for step in range(5):
            for p in ps:
                g = torch.randn(p.shape, device="cuda")
                if p.grad is None:
                    p.grad = _dtensor(g, mesh)
                else:
                    p.grad._local_tensor.copy_(g)
            w.param_groups[0]["lr"] = 0.0 if step == 3 else 1e-2
            before = [_local(p).clone() for p in ps]
            with _no_sync(step > 0):
                w.step()
                w.zero_grad(set_to_none=False)
            moved = [not torch.equal(b, _local(p)) for b, p in zip(before, ps, strict=True)]
            assert moved == [step != 3] * len(ps), (step, moved)
        assert w._captured.graph.replays == 4


def test_gloo_group_is_refused(tmp_path):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    with _nccl_world_of_one(tmp_path, backend="gloo") as mesh:
        ps = [torch.nn.Parameter(_dtensor(torch.zeros(4, 2, device="cuda"), mesh))]
        with pytest.raises(ValueError, match="NCCL group"):
            FullyShardedOptimizer(
                torch.optim.AdamW(ps, fused=True),
                OptimizerConfig(host_sync=False, cuda_graph=True),
            )
