"""The whole-param step under ``host_sync=False`` on a CUDA device, world size 1 on NCCL.

* Muon + fused AdamW with clipping, a DynamicGradScaler and an inf planted at one step: every
  step after the first (which builds Muon's plan) runs under
  ``torch.cuda.set_sync_debug_mode("error")``, and the trajectory is bit for bit the
  ``host_sync=True`` one.
* The captured step (``cuda_graph=True``) with Muon + fused AdamW: bit for bit the eager
  ``host_sync=False`` wrapper on the same grads (written in place, as FSDP2 does), an inf skipped
  on the device, AdamW's lr changed at every step (read from device memory), Muon's lr fixed
  (baked into the graph); every step after the first under the sync check.
* The generic path: an unknown class whose own step reads nothing syncs nothing after its first
  step; torch's Adafactor syncs exactly as often as stock Adafactor on the same tensors (its
  own ``.item()`` reads of two norms per param), nothing more.

Skipped without a CUDA device (``scripts/gpu_check.sh`` runs them: ``pytest -m cuda``).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

MUON_SHAPES = [(64, 32), (32, 96), (17, 5), (1, 8)]  # wide, tall, odd, one row
ADAMW_SHAPES = [(33,), (64, 32), (2048,)]
STEPS = 7
INF_STEP = 3


@contextmanager
def _nccl_world_of_one(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        dist.all_reduce(torch.zeros(1, device="cuda"))  # the communicator, outside the check
        torch.cuda.synchronize()
        yield mesh
    finally:
        dist.destroy_process_group()


@contextmanager
def _sync_check(on: bool, mode: str = "error"):
    if on:
        torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _dtensor(local, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


def _local(t):
    return getattr(t, "_local_tensor", t)


def _model(params):
    model = torch.nn.Module()
    for i, p in enumerate(params):
        model.register_parameter(f"p{i}", p)
    return model


def _muon_adamw(mesh, init, config, scaler=True):
    """Muon over the first ``len(MUON_SHAPES)`` params, fused AdamW over the rest."""
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer

    ps = [torch.nn.Parameter(_dtensor(t.clone(), mesh)) for t in init]
    n = len(MUON_SHAPES)
    w = FullyShardedOptimizer(
        [
            torch.optim.Muon(ps[:n], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(ps[n:], lr=2.0**-7, weight_decay=0.1, fused=True),
        ],
        config,
        grad_scaler=DynamicGradScaler(2.0**10, growth_interval=2, hysteresis=1) if scaler else None,
        model_chunks=[_model(ps)],
    )
    return w, ps


def _write_grads(ps, grads, mesh):
    """The grads written into the tensors of the last step (new ones the first time)."""
    for p, g in zip(ps, grads, strict=True):
        if p.grad is None:
            p.grad = _dtensor(g.clone(), mesh)
        else:
            p.grad._local_tensor.copy_(g)


def _check_same(step, wa, pa, wb, pb):
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        assert torch.equal(_local(a), _local(b)), (step, "param", i)
        sa = next(o.state[a] for o in wa.optimizers if a in o.state)
        sb = next(o.state[b] for o in wb.optimizers if b in o.state)
        assert set(sa) == set(sb), (step, set(sa), set(sb))
        for k in sa:
            assert torch.equal(_local(sa[k]), _local(sb[k])), (step, k, i)
    assert wa.grad_scaler.state_dict() == wb.grad_scaler.state_dict(), step


def test_muon_and_adamw_without_host_sync_never_sync(tmp_path):
    """Every step after the first under ``set_sync_debug_mode("error")``, the skipped one
    included; bit for bit the host-synced wrapper.

    Both run torch's fused kernel for AdamW (``triton_adam_step=False``): the host-synced
    wrapper's first step is the class's own ``step()`` (torch's kernel, which creates the
    state), while ``host_sync=False`` creates the state up front and runs the fast step from
    the first, which with the Triton kernel would differ at that step in the last bits of
    ``exp_avg`` (torch's kernel takes ``(1 - beta1) * grad`` in float64, the Triton kernel in
    float32; seen on an H100). The captured test below covers Triton under
    ``host_sync=False``."""
    from mfsdp_optim import OptimizerConfig

    with _nccl_world_of_one(tmp_path) as mesh:
        from test_cuda_graph import _prime_stats_kernel

        _prime_stats_kernel()  # the first launch may sum in another order (test_cuda_graph)
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = MUON_SHAPES + ADAMW_SHAPES
        init = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        (wd, pd), (wh, ph) = [
            _muon_adamw(
                mesh,
                init,
                OptimizerConfig(clip_grad=0.5, host_sync=host_sync, triton_adam_step=False),
            )
            for host_sync in (False, True)
        ]
        oks = []
        for step in range(STEPS):
            grads = [torch.randn(s, device="cuda", generator=gen) * 2.0**10 for s in shapes]
            if step == INF_STEP:
                grads[0].view(-1)[0] = float("inf")  # in Muon's grads: both skip
            _write_grads(pd, grads, mesh)
            _write_grads(ph, grads, mesh)
            with _sync_check(step > 0):  # the first step builds Muon's plan (object gather)
                ok, norm, _ = wd.step()
                wd.zero_grad(set_to_none=False)
            host = wh.step()
            wh.zero_grad(set_to_none=False)
            assert bool(ok) == host[0], step
            assert float(norm) == host[1] or (norm.isnan() and host[1] != host[1]), step
            _check_same(step, wd, pd, wh, ph)
            oks.append(host[0])
        assert oks == [s != INF_STEP for s in range(STEPS)], oks
        assert wd._engines[0].whole_steady()  # Muon stepped on the device


@pytest.mark.parametrize("variant", ["triton", "torch"])
def test_captured_muon_and_adamw_match_eager_bit_for_bit(tmp_path, variant):
    """Step 0 builds Muon's plan (eager), step 1 warms up and captures, the rest replay: bit
    for bit the eager host_sync=False wrapper, the skip at the planted inf included."""
    from mfsdp_optim import OptimizerConfig
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    triton = variant == "triton"
    if triton and not TritonAdam.available():
        pytest.skip("needs Triton")
    with _nccl_world_of_one(tmp_path) as mesh:
        from test_cuda_graph import _prime_stats_kernel

        _prime_stats_kernel()
        gen = torch.Generator(device="cuda").manual_seed(1)
        shapes = MUON_SHAPES + ADAMW_SHAPES
        init = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        pairs = []
        for cuda_graph in (True, False):
            config = OptimizerConfig(
                clip_grad=0.5,
                log_num_zeros_in_grad=True,
                host_sync=False,
                triton_adam_step=triton,
                cuda_graph=cuda_graph,
            )
            pairs.append(_muon_adamw(mesh, init, config))
        (wc, pc), (we, pe) = pairs
        kept = []
        for step in range(STEPS):
            grads = [torch.randn(s, device="cuda", generator=gen) * 2.0**10 for s in shapes]
            if step == INF_STEP:
                grads[-1].view(-1)[0] = float("inf")
            with _sync_check(step > 0):
                for w, ps in ((wc, pc), (we, pe)):
                    _write_grads(ps, grads, mesh)
                    w.optimizers[1].param_groups[0]["lr"] = 2.0**-7 * (1 + step % 3)
                rc, re_ = wc.step(), we.step()
                kept.append((rc, re_))
                for w in (wc, we):
                    w.zero_grad(set_to_none=False)
            _check_same(step, wc, pc, we, pe)
            graph = wc._captured.graph
            assert graph.disabled is None, graph.disabled
            assert graph.captures == (0 if step == 0 else 1), (step, graph.captures)
        for step, (a, b) in enumerate(kept):
            assert bool(a[0]) == bool(b[0]) == (step != INF_STEP), step
            assert torch.equal(a[1], b[1]) or (a[1].isnan() and b[1].isnan()), step
            assert torch.equal(a[2], b[2]), step
        assert graph.replays == STEPS - 2


def test_generic_whole_param_without_host_sync_never_syncs(tmp_path):
    """An unknown whole-param class whose own step reads nothing on the host: after its first
    step (the plan, the gloo group of its host-side values), no sync."""
    from test_whole_param import NormalizedSGD

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    with _nccl_world_of_one(tmp_path) as mesh:
        ps = [
            torch.nn.Parameter(_dtensor(torch.randn(s, device="cuda"), mesh)) for s in MUON_SHAPES
        ]
        w = FullyShardedOptimizer(
            NormalizedSGD(ps, lr=0.1),
            OptimizerConfig(
                clip_grad=1.0, host_sync=False, update_kinds={NormalizedSGD: "whole_param"}
            ),
            model_chunks=[_model(ps)],
        )
        for step in range(4):
            _write_grads(ps, [torch.randn(p.shape, device="cuda") for p in ps], mesh)
            with _sync_check(step > 0):
                ok, _, _ = w.step()
                w.zero_grad(set_to_none=False)
            assert isinstance(ok, torch.Tensor)
        assert all(w.optimizer.state[p]["count"] == 4 for p in ps)


def _syncs(fn) -> int:
    """How many synchronising CUDA calls ``fn`` made (``set_sync_debug_mode("warn")``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _sync_check(True, "warn"):
            fn()
    return sum("synchroniz" in str(c.message) for c in caught)


def test_adafactor_without_host_sync_syncs_as_stock_does(tmp_path):
    """torch's Adafactor reads two norms per param on the host in its own step: under the
    wrapper (host_sync=False) every later step makes exactly stock Adafactor's syncs on the same
    tensors, none of the package's own; and the same bits."""
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    with _nccl_world_of_one(tmp_path) as mesh:
        gen = torch.Generator(device="cuda").manual_seed(2)
        init = [torch.randn(s, device="cuda", generator=gen) for s in MUON_SHAPES]
        ps = [torch.nn.Parameter(_dtensor(t.clone(), mesh)) for t in init]
        stock = [torch.nn.Parameter(t.clone()) for t in init]
        w = FullyShardedOptimizer(
            torch.optim.Adafactor(ps, lr=0.01),
            OptimizerConfig(host_sync=False),
            model_chunks=[_model(ps)],
        )
        ref = torch.optim.Adafactor(stock, lr=0.01)
        counts = []
        for step in range(4):
            grads = [torch.randn(s, device="cuda", generator=gen) for s in MUON_SHAPES]
            _write_grads(ps, grads, mesh)
            for p, g in zip(stock, grads, strict=True):
                p.grad = g.clone()
            torch.cuda.synchronize()
            mine = _syncs(w.step)
            theirs = _syncs(ref.step)
            counts.append((mine, theirs))
            for a, b in zip(ps, stock, strict=True):
                assert torch.equal(_local(a), b), step
            w.zero_grad(set_to_none=False)
        assert all(mine == theirs > 0 for mine, theirs in counts[1:]), counts
