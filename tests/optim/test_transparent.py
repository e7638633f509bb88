"""Wrapping never changes the user's optimizer: against stock torch stepping the same DTensors.

Every rank builds two identical FSDP2 models (uneven layer sizes: some ranks hold empty shards).
One is trained by stock torch (the base optimizer stepping DTensors), the other through
FullyShardedOptimizer, on the same batches, without clipping (so both run the same kernels on
the same values and must agree bit for bit). After every step the wrapped base optimizer must
look exactly like the stock one: its param lists hold the model's DTensors, its state is keyed
by them with DTensor entries in the param's layout, ``state_dict()`` matches, stock
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` work on both objects, and dropping
the wrapper continues exactly like stock torch.
"""

from __future__ import annotations

import os

import pytest
import torch

CASES = {
    "Adam-foreach": (torch.optim.Adam, dict(lr=0.01, foreach=True)),
    "Adam-fused": (torch.optim.Adam, dict(lr=0.01, fused=True)),
    "AdamW-foreach": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
    "AdamW-fused": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
}


def _pair(cls, kw, filt: bool):
    """(stock model, stock optimizer, model, base, wrapper) on one 1-D mesh."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from _models import _model, _shard

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((dist.get_world_size(),))
    stock_model, model = _model(0), _model(0)
    _shard(stock_model, mesh)
    _shard(model, mesh)

    def groups(m):  # two groups, as torchtitan builds them (decay / no decay)
        named = list(m.named_parameters())
        return [
            {"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": kw["lr"] / 2},
        ]

    stock = cls(groups(stock_model), **kw)
    base = cls(groups(model), **kw)
    wrapper = FullyShardedOptimizer(
        base, OptimizerConfig(filter_empty_shards=filt), model_chunks=[model]
    )
    return stock_model, stock, model, base, wrapper


def _train(model, opt, steps, start=0):
    from _models import _batch

    for step in range(start, start + steps):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _same_tensor(a, b) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return (
            isinstance(a, DTensor)
            and isinstance(b, DTensor)
            and a.device_mesh == b.device_mesh
            and a.placements == b.placements
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a._local_tensor, b._local_tensor)
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b) and a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
        )
    return a == b


def _check_stock(stock_model, stock, model, base, filt: bool) -> None:
    """The wrapped base optimizer is what stock torch holds, entry by entry."""
    names = [n for n, _ in model.named_parameters()]
    ours, theirs = dict(model.named_parameters()), dict(stock_model.named_parameters())
    assert [p for g in base.param_groups for p in g["params"]] == [
        p
        for g in [{"params": [ours[n] for n in names if n.endswith(s)]} for s in ("weight", "bias")]
        for p in g["params"]
    ], "param lists changed"
    assert all(
        isinstance(p, type(next(model.parameters())))
        for g in base.param_groups
        for p in g["params"]
    )
    assert set(base.state) <= set(ours.values()), "state keyed by something else"
    for n in names:
        p, q = ours[n], theirs[n]
        assert torch.equal(p._local_tensor, q._local_tensor), f"param {n}"
        if filt and p._local_tensor.numel() == 0:
            # never stepped here; only state the optimizer made itself (Adagrad) may exist
            st = base.state.get(p, {})
            assert not st or float(st["step"]) == 0, f"{n}: filtered, yet stepped"
            continue
        mine, ref = base.state.get(p, {}), stock.state.get(q, {})
        assert set(mine) == set(ref), (n, set(mine), set(ref))
        for k in ref:
            assert _same_tensor(mine[k], ref[k]), (n, k, mine[k], ref[k])


def _check_state_dicts(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert set(a["state"]) == set(b["state"])
    for i in a["state"]:
        assert set(a["state"][i]) == set(b["state"][i]), i
        for k in a["state"][i]:
            assert _same_tensor(a["state"][i][k], b["state"][i][k]), (i, k)


def _flat_equal(a: dict, b: dict) -> None:
    """Two get_optimizer_state_dict results: same FQNs, keys and values."""
    assert set(a["state"]) == set(b["state"]), (sorted(a["state"]), sorted(b["state"]))
    for fqn in a["state"]:
        for k in set(a["state"][fqn]) | set(b["state"][fqn]):
            assert _same_tensor(a["state"][fqn][k], b["state"][fqn][k]), (fqn, k)
    assert a["param_groups"] == b["param_groups"]


def _rank_transparent(name: str, filt: bool, ckpt_dir: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    cls, kw = CASES[name]
    stock_model, stock, model, base, wrapper = _pair(cls, kw, filt)
    calls = {"global_pre": 0, "global_post": 0, "wrapper": 0, "base": 0}
    handles = [
        register_optimizer_step_pre_hook(
            lambda *a: calls.__setitem__("global_pre", calls["global_pre"] + 1)
        ),
        register_optimizer_step_post_hook(
            lambda *a: calls.__setitem__("global_post", calls["global_post"] + 1)
        ),
        wrapper.register_step_post_hook(
            lambda *a: calls.__setitem__("wrapper", calls["wrapper"] + 1)
        ),
    ]
    try:
        for step in range(3):
            _train(stock_model, stock, 1, start=step)
            _train(model, wrapper, 1, start=step)
            _check_stock(stock_model, stock, model, base, filt)
        stock_calls = dict(calls)
        assert stock_calls == {"global_pre": 6, "global_post": 6, "wrapper": 3, "base": 0}, calls
        # the base optimizer's own hooks fire whenever its step runs (once per wrapper step)
        handles.append(
            base.register_step_post_hook(lambda *a: calls.__setitem__("base", calls["base"] + 1))
        )
        _train(stock_model, stock, 1, start=3)
        _train(model, wrapper, 1, start=3)
        _check_stock(stock_model, stock, model, base, filt)
        assert calls["base"] == 1 and calls["wrapper"] == 4 and calls["global_post"] == 8, calls
    finally:
        for h in handles:
            h.remove()

    # base.zero_grad() clears the model's grads
    from _models import _batch

    model(_batch(9)).sum().backward()
    base.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    out = {}
    if filt:  # ranks hold different stock layouts: state_dict() refuses, pointing elsewhere
        try:
            wrapper.state_dict()
        except NotImplementedError as exc:
            out["refused"] = "sharded_state_dict" in str(exc)
        return out

    # state_dict(): the base's stock layout, on both objects
    _check_state_dicts(wrapper.state_dict(), stock.state_dict())
    _check_state_dicts(base.state_dict(), stock.state_dict())
    # stock helpers on the base and on the wrapper
    ref_osd = get_optimizer_state_dict(stock_model, stock)
    _flat_equal(get_optimizer_state_dict(model, base), ref_osd)
    _flat_equal(get_optimizer_state_dict(model, wrapper), ref_osd)
    # a stock checkpoint written through the wrapper with the stock helpers
    path = os.path.join(ckpt_dir, f"{name}")
    dcp.save({"optimizer": get_optimizer_state_dict(model, wrapper)}, checkpoint_id=path)

    # unwrap: plain torch continues exactly like stock
    _train(stock_model, stock, 2, start=4)
    _train(model, base, 2, start=4)
    _check_stock(stock_model, stock, model, base, filt)

    # set_optimizer_state_dict through the wrapper (torch calls load_state_dict(state_dict=...))
    # on a fresh pair, then both continue: still bit for bit
    stock_model2, stock2, model2, base2, wrapper2 = _pair(cls, kw, filt)
    for m, o in ((stock_model2, stock2), (model2, wrapper2)):
        osd = get_optimizer_state_dict(m, o)
        dcp.load({"optimizer": osd}, checkpoint_id=path)
        set_optimizer_state_dict(m, o, osd)
    with torch.no_grad():  # the params come from the trained models, as a model checkpoint would
        for (_, p), (_, q), (_, r) in zip(
            model2.named_parameters(),
            stock_model2.named_parameters(),
            model.named_parameters(),
            strict=True,
        ):
            p._local_tensor.copy_(r._local_tensor)
            q._local_tensor.copy_(r._local_tensor)
    # the wrapped state equals what stock torch loaded, and the next steps match too
    _check_stock(stock_model2, stock2, model2, base2, filt)
    _train(stock_model2, stock2, 2, start=10)
    _train(model2, wrapper2, 2, start=10)
    _check_stock(stock_model2, stock2, model2, base2, filt)
    out["ok"] = dist.get_world_size()
    return out


@pytest.mark.parametrize("filt", [False, True], ids=["nofilter", "filter"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_transparent_against_stock(ranks, tmp_path, name, filt):
    results = ranks(2).run(_rank_transparent, name, filt, str(tmp_path))
    if filt:
        assert all(r["refused"] for r in results)
    else:
        assert [r["ok"] for r in results] == [2, 2]


def _rank_reshard(name: str, path: str, write: bool):
    """A stock checkpoint written through the wrapper on one world size, loaded through the
    wrapper on another: equal to stock torch loading the same files, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    cls, kw = CASES[name]
    stock_model, stock, model, base, wrapper = _pair(cls, kw, False)
    if write:
        _train(model, wrapper, 3)
        dcp.save({"optimizer": get_optimizer_state_dict(model, wrapper)}, checkpoint_id=path)
        return True
    for m, o in ((stock_model, stock), (model, wrapper)):
        osd = get_optimizer_state_dict(m, o)
        dcp.load({"optimizer": osd}, checkpoint_id=path)
        set_optimizer_state_dict(m, o, osd)
    _check_stock(stock_model, stock, model, base, False)
    _train(stock_model, stock, 1, start=3)
    _train(model, wrapper, 1, start=3)
    _check_stock(stock_model, stock, model, base, False)
    return True


@pytest.mark.parametrize("name", ["AdamW-fused", "SGD-momentum"])
def test_stock_checkpoint_reshards(ranks, tmp_path, name):
    path = str(tmp_path / "ckpt")
    assert ranks(2).run(_rank_reshard, name, path, True) == [True] * 2
    assert ranks(4).run(_rank_reshard, name, path, False) == [True] * 4


def _rank_compiled_fqns():
    import torch.distributed as dist
    from _layouts import get_mesh
    from _models import _model, _shard
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from mfsdp_optim import FullyShardedOptimizer

    model = _model(0)
    _shard(model, get_mesh((dist.get_world_size(),)))
    compiled = torch.compile(model)  # never called: only its names matter here
    assert all(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    opt = FullyShardedOptimizer(
        torch.optim.Adam(compiled.parameters(), lr=0.01), model_chunks=[compiled]
    )
    _train(compiled, opt, 1)
    ours = sorted(opt.sharded_state_dict()["state"])
    stock = sorted(get_optimizer_state_dict(compiled, opt)["state"])
    return ours, stock, sorted(n for n, _ in model.named_parameters())


def test_compiled_model_fqns_match_stock(ranks):
    for ours, stock, plain in ranks(2).run(_rank_compiled_fqns):
        assert ours == stock == plain


def test_checkpoint_attribute_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, mfsdp_optim\n"
        "assert 'mfsdp_optim.checkpoint' not in sys.modules\n"
        "assert callable(mfsdp_optim.checkpoint.save_checkpoint)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
