"""Several base optimizers in one wrapper: Muon on the 2-D weights, AdamW on the rest.

On 4 gloo ranks under ``fully_shard``, with clipping and a ``DynamicGradScaler``, against the
same two torch optimizers on the unsharded model given the same global grads and
``clip_grad_norm_`` over all params: one global norm (a brute force over ``full_tensor()``),
a NaN planted on one rank's shard skips both optimizers on every rank, and the params follow
the unsharded chain. Then a 4 -> 2 rank resume, through ``sharded_state_dict()`` and through
the stock ``get_/set_optimizer_state_dict(model, wrapper.optimizers)``, continues it.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.distributed as dist
from _models import _model, _shard

CLIP, STEPS, NAN_STEP = 0.3, 4, 1
MUON = dict(lr=0.02, momentum=0.9, weight_decay=0.01)
ADAMW = dict(lr=0.01, weight_decay=0.1)


def _global_grad(name: str, shape, step: int) -> torch.Tensor:
    # crc32, not hash(): str hashes differ between the ranks' processes and this one
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(shape, generator=gen)


def _split(model):
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return matrices, rest


def _wrapped(mesh):
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    model = _model(0)
    _shard(model, mesh)
    matrices, rest = _split(model)
    opt = FullyShardedOptimizer(
        [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)],
        OptimizerConfig(clip_grad=CLIP),
        grad_scaler=DynamicGradScaler(initial_scale=1.0, growth_interval=1000),
        model_chunks=[model],
    )
    return model, opt


def _set_grads(model, step: int, plant_nan: bool, scale: torch.Tensor) -> float:
    """Every param's grad from its global grad times the loss scale (a power of two, so
    unscaling is exact); returns the brute-force global norm of the unscaled grads."""
    from torch.distributed.tensor import distribute_tensor

    total = 0.0
    for name, p in model.named_parameters():
        g = _global_grad(name, p.shape, step)
        total += float(g.double().pow(2).sum())
        p.grad = distribute_tensor(g * scale, p.device_mesh, p.placements)
    if plant_nan and dist.get_rank() == 1:
        p = next(q for q in model.parameters() if q.grad._local_tensor.numel() > 0)
        p.grad._local_tensor.view(-1)[0] = float("nan")
    return math.sqrt(total)


def _train(model, opt, steps, first):
    out = []
    for step in range(first, first + steps):
        brute = _set_grads(model, step, step == NAN_STEP, opt.get_loss_scale())
        ok, norm, _ = opt.step()
        out.append((ok, norm, brute))
        opt.zero_grad()
    return out


def _params(model):
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _rank_chain(steps):
    from _layouts import get_mesh

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)))
    return _train(model, opt, steps, 0), _params(model)


def _reference(steps, first=0, model=None, opts=None):
    """The unsharded chain: clip_grad_norm_ over all params, then Muon and AdamW; the NaN
    step is skipped as the wrapper skips it."""
    model = _model(0) if model is None else model
    if opts is None:
        matrices, rest = _split(model)
        opts = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)]
    for step in range(first, first + steps):
        for name, p in model.named_parameters():
            p.grad = _global_grad(name, p.shape, step)
        if step != NAN_STEP:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for o in opts:
                o.step()
        for o in opts:
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_chain_one_norm_one_skip_and_the_unsharded_updates(ranks):
    results = ranks(4).run(_rank_chain, STEPS)
    ref = _reference(STEPS)
    for rank, (steps, params) in enumerate(results):
        for step, (ok, norm, brute) in enumerate(steps):
            assert ok == (step != NAN_STEP), f"rank {rank} step {step}: skip decided differently"
            if step == NAN_STEP:
                assert not math.isfinite(norm)
            else:
                assert norm == pytest.approx(brute, rel=1e-5), (rank, step)
        for name, want in ref.items():
            torch.testing.assert_close(
                params[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def _rank_save(path, how):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)))
    _train(model, opt, 3, 0)
    optim_sd = (
        opt.sharded_state_dict()
        if how == "sharded"
        else get_optimizer_state_dict(model, opt.optimizers)
    )
    dcp.save({"model": get_model_state_dict(model), "optimizer": optim_sd}, checkpoint_id=path)


def _rank_resume(path, how):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)))
    if how == "sharded":
        target = {"model": get_model_state_dict(model)}
        target["optimizer"] = opt.sharded_state_dict(is_loading=True)
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(model, target["model"])
        opt.load_state_dict(target["optimizer"])
    else:
        _train(model, opt, 1, 0)  # stock helpers need state to load into
        target = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt.optimizers),
        }
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt.optimizers, target["optimizer"])
    _train(model, opt, 1, 3)
    return _params(model)


@pytest.mark.parametrize("how", ["sharded", "stock"])
def test_chain_resumes_on_2_ranks(ranks, tmp_path, how):
    path = str(tmp_path / "ckpt")
    ranks(4).run(_rank_save, path, how)
    resumed = ranks(2).run(_rank_resume, path, how)
    ref = _reference(4)
    for params in resumed:
        for name, want in ref.items():
            torch.testing.assert_close(
                params[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
