"""The wrapper over apex's FusedAdam (NVIDIA apex, ``apex.optimizers.FusedAdam``), on CUDA.

One rank (a world-size-1 NCCL group in a spawned process, so a crash in a CUDA kernel fails the
test instead of the session), an FSDP2 MLP in fp32. Two copies of the same model train on the
same batches for STEPS steps with clipping at CLIP: one under the wrapper over apex FusedAdam
(``adam_w_mode=True``; master weights off, and on where this apex has them, which needs
``capturable=True``), the reference under the wrapper over ``torch.optim.AdamW``. Asserted:

- every step's grad norm (the wrapper's stats path) equals a brute-force norm of the full grads
  taken before the step, for both optimizers; at step 1 (same params, same data) the two
  optimizers' norms and losses are bit-identical;
- the losses and final params of the two runs agree within float tolerance, and the params moved
  by far more than that tolerance (so the comparison can fail);
- apex's state keys (exp_avg, exp_avg_sq) match AdamW's values within tolerance;
- ``sharded_state_dict()`` saved with ``dcp.save`` to real files and loaded into a fresh model
  and apex optimizer (``sharded_state_dict(is_loading=True)``, ``dcp.load``, ``load_state_dict``)
  restores the state and the group step bit for bit, and one more step on both gives identical
  params.

Skipped (visibly) without CUDA or without apex; on the device machine apex is built from source
into the git-ignored ``.apex/`` (``bash .apex/build.sh``, see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import tempfile
import traceback

import pytest
import torch


def _apex_fused_adam():
    if importlib.util.find_spec("apex") is None:
        return None
    try:
        import amp_C  # noqa: F401  (the CUDA extension FusedAdam needs)
        from apex.optimizers import FusedAdam
    except (
        ImportError,
        OSError,
    ):  # apex without its CUDA extension, or one built for another torch
        return None
    return FusedAdam


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        _apex_fused_adam() is None,
        reason="apex.optimizers.FusedAdam (with amp_C) is not importable",
    ),
]

STEPS, CLIP, LR, WD = 20, 0.05, 1e-2, 0.1
BETAS, EPS = (0.9, 0.999), 1e-8
# fp32 kernels that round differently (apex: --use_fast_math, its own bias correction order)
RTOL, ATOL = 1e-4, 2e-5


def _model(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 8),
    ).cuda()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    return m


def _batches():
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(16, 32, generator=gen).cuda(), torch.randn(16, 8, generator=gen).cuda())
        for _ in range(STEPS + 1)
    ]


def _apex(model, master: bool):
    FusedAdam = _apex_fused_adam()
    kw = {"capturable": True, "master_weights": True} if master else {}
    return FusedAdam(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True, **kw
    )


def _wrap(base, model):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    return FullyShardedOptimizer(base, OptimizerConfig(clip_grad=CLIP), model_chunks=[model])


def _full_params(model):
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _state(opt):
    """{fqn: {key: full tensor}} of the state, through ``sharded_state_dict()``."""
    sd = opt.sharded_state_dict()
    return {
        n: {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in st.items()
        }
        for n, st in sd["state"].items()
    }


def _group_steps(opt):
    """{param index: step} from the stock ``state_dict()``: apex keeps ``step`` in the param
    group (an int, or a CUDA tensor when capturable), AdamW per param in its state."""
    sd = opt.state_dict()
    out = {}
    for g in sd["param_groups"]:
        for i in g["params"]:
            step = g.get("step", sd["state"].get(i, {}).get("step"))
            out[i] = int(torch.as_tensor(step).reshape(-1)[0])
    return out


def _train_step(model, opt, x, y):
    """(loss, the wrapper's grad norm, a brute-force norm of the full grads before the step)."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    full = [p.grad.full_tensor().double() for p in model.parameters()]
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
    ok, norm, _ = opt.step()
    assert ok
    opt.zero_grad()
    return loss.item(), norm, ref.item()


def _close(a, b, what):
    assert a.shape == b.shape, what
    if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
        err = (a - b).abs().max().item()
        raise AssertionError(f"{what}: max abs diff {err:.3g} beyond rtol={RTOL}, atol={ATOL}")


def _scenario(master: bool, ckpt_dir: str) -> None:
    import torch.distributed.checkpoint as dcp

    batches = _batches()
    model_a, model_r = _model(0), _model(0)
    init = _full_params(model_a)
    opt_a = _wrap(_apex(model_a, master), model_a)
    opt_r = _wrap(
        torch.optim.AdamW(model_r.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        model_r,
    )
    for i, (x, y) in enumerate(batches[:STEPS]):
        la, na, ra = _train_step(model_a, opt_a, x, y)
        lr_, nr, rr = _train_step(model_r, opt_r, x, y)
        # the stats path against brute force, for each optimizer
        assert abs(na - ra) <= 1e-5 * ra, (i, na, ra)
        assert abs(nr - rr) <= 1e-5 * rr, (i, nr, rr)
        if i == 0:  # same params, same batch: the stats path is the same computation
            assert la == lr_ and na == nr, (la, lr_, na, nr)
            assert na > CLIP, "clipping must act for the test to cover it"
        else:
            assert abs(la - lr_) <= RTOL * abs(lr_) + ATOL, (i, la, lr_)
            assert abs(na - nr) <= 1e-3 * nr, (i, na, nr)
    pa, pr = _full_params(model_a), _full_params(model_r)
    for n in pr:
        moved = (pr[n] - init[n]).abs().max().item()
        assert moved > 100 * ATOL, f"{n} barely moved ({moved:.3g}): the comparison is vacuous"
        _close(pa[n], pr[n], f"param {n}")
    # optimizer state through the checkpoint layer (FQN-keyed DTensors of the params' layout)
    st_a, st_r = _state(opt_a), _state(opt_r)
    assert set(st_a) == set(st_r) == set(pr), (sorted(st_a), sorted(pr))
    for n in pr:
        assert set(st_a[n]) == {"exp_avg", "exp_avg_sq"}, sorted(st_a[n])
        for k in st_a[n]:
            _close(st_a[n][k], st_r[n][k], f"state {n}.{k}")

    # checkpoint round trip through real files
    dcp.save({"optimizer": opt_a.sharded_state_dict()}, checkpoint_id=ckpt_dir)
    model_b = _model(1)
    with torch.no_grad():  # the params as trained (before the optimizer: master weights copy them)
        for n, p in model_b.named_parameters():
            p.copy_(dict(model_a.named_parameters())[n])
    opt_b = _wrap(_apex(model_b, master), model_b)
    sd = opt_b.sharded_state_dict(is_loading=True)
    dcp.load({"optimizer": sd}, checkpoint_id=ckpt_dir)
    opt_b.load_state_dict(sd)
    st_a, st_b = _state(opt_a), _state(opt_b)
    for n in st_a:
        for k in st_a[n]:
            assert torch.equal(st_a[n][k], st_b[n][k]), f"restored {n}.{k} differs"
    steps_a, steps_b = _group_steps(opt_a), _group_steps(opt_b)
    assert steps_a == steps_b == {i: STEPS for i in range(len(pr))}, (steps_a, steps_b)
    x, y = batches[STEPS]
    _train_step(model_a, opt_a, x, y)
    _train_step(model_b, opt_b, x, y)
    pa, pb = _full_params(model_a), _full_params(model_b)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), f"param {n} after the resumed step differs"


def _worker(master: bool, ckpt_dir: str, store_path: str, out) -> None:
    try:
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl",
            init_method=f"file://{store_path}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
        try:
            _scenario(master, ckpt_dir)
        finally:
            dist.destroy_process_group()
        out.put(None)
    except BaseException:
        out.put(traceback.format_exc())


def _run(master: bool) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(
            target=_worker,
            args=(master, os.path.join(tmp, "ckpt"), os.path.join(tmp, "store"), out),
        )
        proc.start()
        proc.join(timeout=240)
        if proc.is_alive():
            proc.kill()
            pytest.fail("the apex scenario hung (killed after 240 s)")
        assert proc.exitcode == 0 and not out.empty(), f"worker died, exit code {proc.exitcode}"
        err = out.get()
    if err is not None:
        pytest.fail(f"apex scenario failed on the rank:\n{err}", pytrace=False)


def test_apex_fused_adam_matches_adamw():
    _run(master=False)


def test_apex_fused_adam_master_weights_matches_adamw():
    import inspect

    if "master_weights" not in inspect.signature(_apex_fused_adam().__init__).parameters:
        pytest.skip("this apex FusedAdam has no master_weights")
    _run(master=True)
