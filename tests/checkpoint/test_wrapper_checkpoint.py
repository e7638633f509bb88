"""FullyShardedOptimizer end to end through real DCP files: train on 4 ranks under fully_shard,
save with ``sharded_state_dict()``, load on 2 ranks (and on 2x2 HSDP) with
``sharded_state_dict(is_loading=True)`` + ``dcp.load`` + ``load_state_dict``, and check the global
optimizer state bit for bit and that training continues like the run that never stopped."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import _batch, _model, _shard

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _wrapped(mesh, filter_empty: bool):
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    model = _model(0)
    _shard(model, mesh)
    base = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    opt = FullyShardedOptimizer(
        base,
        OptimizerConfig(clip_grad=0.05, filter_empty_shards=filter_empty),
        grad_scaler=DynamicGradScaler(initial_scale=2.0**4, growth_interval=2),
        model_chunks=[model],
    )
    return model, opt


def _train(model, opt, steps, first):
    norms = []
    for step in range(first, first + steps):
        model(_batch(step)).pow(2).mean().mul(opt.get_loss_scale()).backward()
        ok, norm, _ = opt.step()
        opt.zero_grad()
        norms.append((ok, norm))
    return norms


def _global_state(opt) -> dict:
    """{"fqn.key": full tensor} (``step`` included, from the format-2 leaves) and the
    hyperparameters, the same on every rank (_checkpoint_helpers.global_state)."""
    from _checkpoint_helpers import global_state

    state, meta = global_state(opt.sharded_state_dict())
    out = {
        f"{fqn}.{key}": torch.as_tensor(value).detach().clone()
        for fqn, entry in state.items()
        for key, value in entry.items()
    }
    return out, meta


def _rank_save(path, filter_empty):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), filter_empty)
    _train(model, opt, STEPS_BEFORE, 0)
    dcp.save(
        {
            "model": get_model_state_dict(model),
            "optimizer": opt.sharded_state_dict(),
            "scaler": opt.grad_scaler_state_dict(),
        },
        checkpoint_id=path,
    )
    state, meta = _global_state(opt)
    after = _train(model, opt, STEPS_AFTER, STEPS_BEFORE)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return state, meta, after, params


def _rank_load(path, mesh_shape, filter_empty):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    # a 2-D mesh makes fully_shard HSDP: replicate over dim 0, shard over dim 1
    model, opt = _wrapped(get_mesh(mesh_shape), filter_empty)
    model_sd = get_model_state_dict(model)
    target = {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(is_loading=True),
        "scaler": opt.grad_scaler_state_dict(),
    }
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(model, target["model"])
    opt.load_state_dict(target["optimizer"])
    opt.load_grad_scaler_state_dict(target["scaler"])
    state, meta = _global_state(opt)
    after = _train(model, opt, STEPS_AFTER, STEPS_BEFORE)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return state, meta, after, params


@pytest.mark.parametrize("load_mesh", [(2,), (2, 2)], ids=["fsdp2", "hsdp2x2"])
@pytest.mark.parametrize("filter_empty", [False, True], ids=["all", "filtered"])
def test_save_on_4_load_elsewhere_bit_exact_and_training_continues(
    ranks, tmp_path, load_mesh, filter_empty
):
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_rank_save, path, filter_empty)
    state0, meta0, after0, params0 = saved[0]
    assert any(k.endswith("exp_avg_sq") for k in state0) and len(state0) > 10
    assert any(k.endswith(".step") for k in state0)  # the scalars are compared too
    world = 1
    for n in load_mesh:
        world *= n
    loaded = ranks(world).run(_rank_load, path, load_mesh, filter_empty)
    for state, meta, after, params in loaded:
        assert meta == meta0
        assert sorted(state) == sorted(state0)
        for key, value in state0.items():
            assert torch.equal(state[key], value), f"{key} differs after the reshard"
        # the resumed run follows the uninterrupted one (reduction order differs with the
        # world size, so float tolerance, not bits)
        for (ok, norm), (ok0, norm0) in zip(after, after0, strict=True):
            assert ok == ok0
            assert norm == pytest.approx(norm0, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(p, params0[name], rtol=1e-5, atol=1e-6)
