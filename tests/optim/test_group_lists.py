"""Optimizers that keep per-group lists beside ``param_groups`` (apex FusedAdam's master weights).

``MasterSGD`` below keeps ``param_groups_master`` the way apex's FusedAdam does: one dict per
group whose ``params`` list holds, position by position, an fp32 master copy of each param, and a
group-level ``step``. Its ``step()`` zips the groups' params with the masters, updates the master
(momentum SGD, torch SGD's exact arithmetic) and copies it into the param. Like apex's kernels,
which read raw pointers, it refuses a DTensor master or one that does not match its param.

Against stock torch for real: ``torch.optim.SGD(momentum, foreach=False)`` stepping the same
DTensors on the same batches gives the reference, bit for bit, on 2 and 3 ranks (uneven layers:
some ranks hold empty shards), with the empty-shard filter on and off. Also: the optimizer's
lists are the same objects holding the same DTensors after every step, the checkpoint layer's
materialisation works on it without touching its masters, and lists that drifted apart from the
groups (``add_param_group``) are refused at the next step with a message that says what to do.
"""

from __future__ import annotations

import pytest
import torch

LR, MOMENTUM, STEPS = 0.05, 0.9, 3


class MasterSGD(torch.optim.Optimizer):
    """Momentum SGD on fp32 master copies, laid out as apex's FusedAdam lays out its masters."""

    mfsdp_update_kind = "elementwise"  # declared: the wrapper may step its local shards

    def __init__(self, params, lr: float, momentum: float, tensor_step: bool = False):
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.tensor_step = tensor_step  # apex capturable: the group step is a shape-[1] tensor
        self.capturable = False  # an attribute outside defaults/state/groups, as apex has
        self.param_groups_master = [
            {"params": [p.detach().clone().float() for p in g["params"]]} for g in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        assert not self.capturable
        for group, masters in zip(self.param_groups, self.param_groups_master, strict=True):
            if self.tensor_step:
                step = group.setdefault("step", torch.zeros(1, dtype=torch.int32))
                step += 1  # in place, as apex does: a 0-d step here would fail to broadcast
            else:
                group["step"] = group.get("step", 0) + 1
            for p, m in zip(group["params"], masters["params"], strict=True):
                if isinstance(m, DTensor) or isinstance(p, DTensor) or m.shape != p.shape:
                    raise TypeError("a raw-pointer kernel would pair this param with garbage")
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    buf = state["momentum_buffer"] = p.grad.detach().clone()
                else:
                    buf = state["momentum_buffer"]
                    buf.mul_(group["momentum"]).add_(p.grad)
                m.add_(buf, alpha=-group["lr"])
                p.copy_(m)
        return None


def _models():
    import torch.distributed as dist
    from _layouts import get_mesh
    from _models import _model, _shard

    mesh = get_mesh((dist.get_world_size(),))
    sizes = (6, 5, 3, 1)  # 1- and 3-row layers: empty shards on 2 and 3 ranks
    stock_model, model = _model(0, sizes), _model(0, sizes)
    _shard(stock_model, mesh)
    _shard(model, mesh)
    return stock_model, model


def _rank_master_sgd(filt: bool):
    from _models import _batch
    from torch.distributed.tensor import DTensor

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    stock_model, model = _models()
    stock = torch.optim.SGD(stock_model.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    base = MasterSGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    masters = [list(g["params"]) for g in base.param_groups_master]
    lists = [g["params"] for g in base.param_groups_master]
    assert all(isinstance(m, DTensor) for lst in masters for m in lst)
    wrapper = FullyShardedOptimizer(
        base, OptimizerConfig(filter_empty_shards=filt), model_chunks=[model]
    )
    init = {n: p._local_tensor.clone() for n, p in model.named_parameters()}
    for step in range(STEPS):
        for m, opt in ((stock_model, stock), (model, wrapper)):
            m(_batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        # the optimizer's lists: the same objects, holding the same master DTensors again
        assert [g["params"] for g in base.param_groups_master] == lists
        assert all(
            a is b for x, y in zip(lists, masters, strict=True) for a, b in zip(x, y, strict=True)
        )
        assert base.param_groups[0]["step"] == step + 1
    out = {}
    for (n, p), q in zip(model.named_parameters(), stock_model.parameters(), strict=True):
        local = p._local_tensor
        moved = (local - init[n]).abs().max().item() if local.numel() else 0.0
        out[n] = (torch.equal(p._local_tensor, q._local_tensor), moved, p._local_tensor.numel())
    # the masters hold the params' values (the update went through the shown local masters)
    for p, m in zip(base.param_groups[0]["params"], masters[0], strict=True):
        assert torch.equal(p._local_tensor, m._local_tensor)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("filt", [False, True])
def test_master_weights_step_matches_stock_sgd(ranks, world, filt):
    out = ranks(world).run(_rank_master_sgd, filt)
    empty = 0
    for per_rank in out:
        for n, (equal, _, numel) in per_rank.items():
            assert equal, f"{n}: differs from stock SGD on DTensors"
            empty += numel == 0
    assert empty, "no rank held an empty shard: the filter case is vacuous"
    moved = max(m for per_rank in out for _, m, _ in per_rank.values())
    assert moved > 1e-3, "params barely moved: the comparison is vacuous"


def _rank_materialize():
    from mfsdp_optim import FullyShardedOptimizer

    _, model = _models()
    base = MasterSGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    before = [[m._local_tensor.clone() for m in g["params"]] for g in base.param_groups_master]
    lists = [list(g["params"]) for g in base.param_groups_master]
    wrapper = FullyShardedOptimizer(base, model_chunks=[model])
    sd = wrapper.sharded_state_dict(is_loading=True)
    after = [list(g["params"]) for g in base.param_groups_master]
    assert all(a is b for x, y in zip(lists, after, strict=True) for a, b in zip(x, y, strict=True))
    for x, y in zip(before, base.param_groups_master, strict=True):
        for a, b in zip(x, y["params"], strict=True):
            assert torch.equal(a, b._local_tensor), "materialising moved a master"
    return sorted(sd["state"]), {k for st in sd["state"].values() for k in st}


def test_materialize_steps_a_scratch_copy_with_aligned_masters(ranks):
    for fqns, keys in ranks(2).run(_rank_materialize):
        assert len(fqns) == 6 and keys == {"momentum_buffer"}, (fqns, keys)


def _rank_drifted():
    from _models import _batch

    from mfsdp_optim import FullyShardedOptimizer

    _, model = _models()
    params = list(model.parameters())
    base = MasterSGD(params[:-1], lr=LR, momentum=MOMENTUM)
    wrapper = FullyShardedOptimizer(base, model_chunks=[model])
    base.add_param_group({"params": [params[-1]]})  # param_groups_master is not extended
    model(_batch(0)).sum().backward()
    try:
        wrapper.step()
    except ValueError as exc:
        return str(exc)
    return None


def test_drifted_master_lists_are_refused_before_the_step(ranks):
    for msg in ranks(2).run(_rank_drifted):
        assert msg is not None and "param_groups_master" in msg and "add_param_group" in msg, msg


def _rank_checkpoint(ckpt_dir: str):
    import torch.distributed.checkpoint as dcp
    from _models import _batch

    from mfsdp_optim import FullyShardedOptimizer

    def build():
        _, model = _models()
        base = MasterSGD(model.parameters(), lr=LR, momentum=MOMENTUM, tensor_step=True)
        return model, base, FullyShardedOptimizer(base, model_chunks=[model])

    def train(model, opt, step):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model, base, opt = build()
    for step in range(2):
        train(model, opt, step)
    dcp.save({"optimizer": opt.sharded_state_dict()}, checkpoint_id=ckpt_dir)
    _, model_b = _models()
    with torch.no_grad():  # the trained params, before the masters are copied from them
        for p, q in zip(model_b.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    base_b = MasterSGD(model_b.parameters(), lr=LR, momentum=MOMENTUM, tensor_step=True)
    opt_b = FullyShardedOptimizer(base_b, model_chunks=[model_b])
    sd = opt_b.sharded_state_dict(is_loading=True)
    dcp.load({"optimizer": sd}, checkpoint_id=ckpt_dir)
    opt_b.load_state_dict(sd)
    step_b = base_b.param_groups[0]["step"]
    shape, value = tuple(step_b.shape), int(step_b)  # read now: the next step adds in place
    train(model, opt, 2)
    train(model_b, opt_b, 2)
    same = all(
        torch.equal(p._local_tensor, q._local_tensor)
        for p, q in zip(model.parameters(), model_b.parameters(), strict=True)
    )
    return shape, value, same


def test_checkpoint_round_trip_keeps_a_shape_one_group_step(ranks, tmp_path):
    for shape, step, same in ranks(2).run(_rank_checkpoint, str(tmp_path / "ckpt")):
        assert shape == (1,) and step == 2, (shape, step)
        assert same, "the resumed step differs from the continued one"
