"""Interop with stock torch on real DCP files (fully_shard models, get/set_optimizer_state_dict),
the DCP Stateful adapter, and the ``inspect`` command line."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _checkpoint_helpers import DATA, Model, global_state, same
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from mfsdp_optim._infra.params import ParamRecord
from mfsdp_optim.checkpoint import (
    OptimizerStateful,
    build_sharded_state_dict,
    from_torch_state_dict,
    load_sharded_state_dict,
    prune_to_checkpoint,
    to_torch_state_dict,
)

LR = 0.01


def _fsdp_model():
    from _layouts import get_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # same init on every rank and world size
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    mesh = get_mesh((torch.distributed.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, steps=2, skip=()):
    for t in range(steps):
        for name, p in model.named_parameters():
            p.grad = None if name in skip else torch.sin(p.detach() * (t + 1))  # DTensor, no comm
        opt.step()


def _stock_state(model, opt):
    osd = get_optimizer_state_dict(model, opt)
    return global_state(from_torch_state_dict(osd))[0]


def _ours(model):
    """A base optimizer fed local-shard aliases, as FullyShardedOptimizer does."""
    records = [ParamRecord(n, p, p._local_tensor) for n, p in model.named_parameters()]
    opt = torch.optim.AdamW([r.opt_param for r in records], lr=LR * 7, weight_decay=0.1)
    return opt, records


def _stock_writes(path, skip):
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _train(model, opt, skip=skip)
    osd = get_optimizer_state_dict(model, opt)
    dcp.save({"optimizer": osd}, checkpoint_id=path)
    return _stock_state(model, opt), [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]


def _ours_reads_stock(path, partial):
    model = _fsdp_model()
    opt, records = _ours(model)
    sd = build_sharded_state_dict(opt, records, is_loading=True)
    osd = to_torch_state_dict(sd)
    if partial:
        osd = prune_to_checkpoint(osd, path)
    dcp.load({"optimizer": osd}, checkpoint_id=path)
    load_sharded_state_dict(opt, records, from_torch_state_dict(osd))
    return global_state(build_sharded_state_dict(opt, records))[0], [
        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
    ]


def _stock_reads(path):
    """Pure stock torch loading a file written with to_torch_state_dict."""
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR * 3, weight_decay=0.1)
    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"optimizer": osd}, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, osd)
    return _stock_state(model, opt), opt.param_groups[0]["lr"]


def _stock_reads_native(path):
    """Stock torch reading our native fsdp_dtensor file through the converters."""
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR * 3, weight_decay=0.1)
    target = from_torch_state_dict(get_optimizer_state_dict(model, opt))
    dcp.load({"optimizer": target}, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, to_torch_state_dict(target))
    return _stock_state(model, opt), opt.param_groups[0]["lr"]


def _ours_writes(path_torch, path_native):
    model = _fsdp_model()
    opt, records = _ours(model)
    opt.param_groups[0]["lr"] = LR
    _train_alias(model, opt, records)
    sd = build_sharded_state_dict(opt, records)
    dcp.save({"optimizer": to_torch_state_dict(sd)}, checkpoint_id=path_torch)
    dcp.save({"optimizer": sd}, checkpoint_id=path_native)
    return global_state(sd)[0]


def _train_alias(model, opt, records, steps=2):
    for t in range(steps):
        for r in records:
            r.opt_param.grad = torch.sin(r.param.detach() * (t + 1))._local_tensor
        opt.step()


def _stock_fails_on_partial(path):
    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    osd = get_optimizer_state_dict(model, opt)
    try:
        dcp.load({"optimizer": osd}, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, osd)
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException(BaseException)
        return f"{type(exc).__name__}: {exc}"
    return None


def test_stock_checkpoint_loads_into_ours(ranks, tmp_path):
    path = str(tmp_path / "stock")
    saved, groups = ranks(4).run(_stock_writes, path, ())[0]
    for world in (4, 2):
        out = ranks(world).run(_ours_reads_stock, path, False)
        for state, our_groups in out:
            assert same(state, saved), world
            assert our_groups[0]["lr"] == groups[0]["lr"] == LR


def test_ours_loads_into_stock(ranks, tmp_path):
    p_torch, p_native = str(tmp_path / "as_torch"), str(tmp_path / "native")
    saved = ranks(4).run(_ours_writes, p_torch, p_native)[0]
    for world in (4, 2):
        for fn, path in ((_stock_reads, p_torch), (_stock_reads_native, p_native)):
            out = ranks(world).run(fn, path)
            for state, lr in out:
                assert same(state, saved), (world, fn.__name__)
                assert lr == LR


def test_partial_stock_checkpoint(ranks, tmp_path):
    path = str(tmp_path / "partial")
    skip = ("2.bias",)
    saved, _ = ranks(4).run(_stock_writes, path, skip)[0]
    assert "2.bias" not in saved and "2.weight" in saved
    errors = ranks(4).run(_stock_fails_on_partial, path)
    assert all(e and "Missing key in checkpoint" in e for e in errors), errors
    out = ranks(2).run(_ours_reads_stock, path, True)
    assert all(same(state, saved) for state, _ in out)


# ------------------------------------------------------------------------------------------
# the DCP Stateful adapter


class _Scaler:
    def __init__(self, scale):
        self.scale, self.growth_tracker = scale, 0

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, sd):
        if set(sd) != {"scale", "growth_tracker"}:
            raise ValueError(f"bad scaler state {sorted(sd)}")
        self.scale, self.growth_tracker = float(sd["scale"]), int(sd["growth_tracker"])


class _WrapperLike:
    """What the adapter needs of FullyShardedOptimizer."""

    def __init__(self, model, scale):
        self.model, self.grad_scaler = model, _Scaler(scale)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, metadata=None):
        return build_sharded_state_dict(
            self.model.optimizer, self.model.records, is_loading=is_loading
        )

    def load_state_dict(self, sd):
        load_sharded_state_dict(self.model.optimizer, self.model.records, sd)


def _stateful_roundtrip(path):
    src = Model("fsdp", "adam")
    for t in range(2):
        src.step(t)
    w = _WrapperLike(src, 1024.0)
    w.grad_scaler.growth_tracker = 7
    dcp.save({"optimizer": OptimizerStateful(w, materialize=False)}, checkpoint_id=path)
    want = global_state(w.sharded_state_dict())

    dst = _WrapperLike(Model("fsdp", "adam", lr_scale=5.0), 1.0)
    dcp.load({"optimizer": OptimizerStateful(dst)}, checkpoint_id=path)
    got = global_state(dst.sharded_state_dict())
    return same(got, want), dst.grad_scaler.state_dict()


def test_stateful_adapter_with_grad_scaler(ranks, tmp_path):
    out = ranks(4).run(_stateful_roundtrip, str(tmp_path / "stateful"))
    for ok, scaler in out:
        assert ok
        assert scaler == {"scale": 1024.0, "growth_tracker": 7}


# ------------------------------------------------------------------------------------------
# python -m mfsdp_optim.checkpoint inspect DIR


def _inspect(capsys, *args):
    from mfsdp_optim.checkpoint._cli import main

    code = main(["inspect", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_cli(ranks, tmp_path, capsys):
    import json

    native, as_torch = str(tmp_path / "native"), str(tmp_path / "torch")
    ranks(4).run(_ours_writes, as_torch, native)
    # the real entry point once, in a fresh interpreter
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "mfsdp_optim.checkpoint", "inspect", native],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    code, out, _ = _inspect(capsys, native)
    assert code == 0 and out == r.stdout
    assert (
        "[optimizer] layout fsdp_dtensor (format 3): 4 params, 4 with state, 1 group(s)" in out
    ), out
    # the group's hyperparameters once, then the params with shapes, dtypes and steps
    assert out.count("lr=0.01") == 1 and out.count("weight_decay=0.1") == 1, out
    for line in (
        "group 0 (4 params): ",
        "betas=(0.9, 0.999)",
        "0.weight  exp_avg float32 6x8, exp_avg_sq float32 6x8; step=2",
        "totals: 4 params",
        "written by 4 rank(s)",
    ):
        assert line in out, (line, out)
    code, out, _ = _inspect(capsys, as_torch)
    assert code == 0 and "layout torch (get_optimizer_state_dict): 4 params" in out, out
    assert out.count("lr=0.01") == 1 and "2.bias" in out and "step float32 scalar" in out, out
    # --no-values reads .metadata alone and says so, instead of printing None as values
    code, out, _ = _inspect(capsys, native, "--no-values")
    assert code == 0 and "hyperparameters not read (--no-values)" in out and "None" not in out
    code, out, _ = _inspect(capsys, native, "--json")
    report = json.loads(out)
    opt = report["optimizers"]["optimizer"]
    assert code == 0 and opt["format"] == 3 and opt["params"] == 4 and report["ranks"] == 4
    assert opt["groups"][0]["hyperparameters"]["lr"] == 0.01
    assert opt["groups"][0]["params"]["0.weight"]["scalars"] == {"step": 2.0}
    assert opt["groups"][0]["params"]["0.weight"]["state"]["exp_avg"] == {
        "dtype": "float32",
        "shape": [6, 8],
        "bytes": 192,
    }
    # the checked-in format-2 checkpoint still lists (two groups; "frozen" without state)
    fixture = os.path.join(DATA, "ckpt_format2")
    code, out, _ = _inspect(capsys, fixture)
    assert code == 0, out
    assert "layout fsdp_dtensor (format 2): 4 params, 3 with state, 2 group(s)" in out, out
    assert "frozen    no state (never stepped when saved)" in out, out
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _inspect(capsys, str(empty))
    assert code == 2 and "no .metadata" in err and "not a finished" in err
    code, _, err = _inspect(capsys, str(tmp_path / "missing"))
    assert code == 2 and "no such checkpoint directory" in err
    code, _, _ = _inspect(capsys, native, "--bogus")
    assert code == 2


def _damage(path: str, how: str) -> None:
    shard = os.path.join(path, "__0_0.distcp")
    if how == "truncated shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif how == "missing shard":
        os.remove(shard)
    elif how == "edited .metadata":  # a shape changed: the marker's SHA-256 no longer matches
        from mfsdp_optim.checkpoint import safe_read_metadata

        md = safe_read_metadata(path)
        item = md.state_dict_metadata["optimizer.state.0.weight.exp_avg"]
        item.size = torch.Size([60, 8])
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(md, f)


@pytest.mark.parametrize("how", ["truncated shard", "missing shard", "edited .metadata"])
@pytest.mark.parametrize("marker", [True, False], ids=["save_checkpoint", "plain_dcp"])
def test_inspect_never_calls_damaged_complete(tmp_path, capsys, how, marker):
    from mfsdp_optim.checkpoint import save_checkpoint

    path = str(tmp_path / "ckpt")
    sd = {
        "optimizer": {
            "state": {"0.weight": {"exp_avg": torch.ones(6, 8)}},
            "param_to_group_meta": {"0.weight": ((("lr", 0.1),), ())},
        }
    }
    save_checkpoint(sd, path)
    if not marker:  # what plain dcp.save leaves
        os.remove(os.path.join(path, "mfsdp_complete.json"))
    assert _inspect(capsys, path)[0] == 0  # precondition: whole before the damage
    _damage(path, how)
    if not marker and how == "edited .metadata":
        # without the marker nothing records what .metadata was: the claim is only that
        # every item still lies inside its file, so this one passes as whole, with its shape
        code, out, _ = _inspect(capsys, path)
        assert code == 0 and "60x8" in out
        return
    for extra in ((), ("--no-values",), ("--json",)):
        code, out, err = _inspect(capsys, path, *extra)
        assert code == 3, (how, extra, code, out, err)
        assert "complete" not in out and "Traceback" not in err, (out, err)


@pytest.mark.parametrize("layout", ["torch", "fsdp_dtensor", "format1"])
def test_converters_share_tensors_and_do_not_mutate(layout):
    t = torch.ones(3)
    step = torch.tensor(4.0)
    hyper = (("betas", (0.9, 0.99)), ("lr", 0.1))
    if layout == "torch":
        osd = {
            "state": {"a": {"exp_avg": t, "step": step}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"]}],
        }
        sd = from_torch_state_dict(osd)
        # format 2: one (hyperparameters, scalars) leaf per FQN; step leaves state
        assert sd["param_to_group_meta"] == {
            "a": (hyper, (("step", 4.0, "float32"),)),
            "b": (hyper, ()),
        }
        assert sd["state"] == {"a": {"exp_avg": t}} and sd["state"]["a"]["exp_avg"] is t
        assert osd["param_groups"][0]["params"] == ["a", "b"] and osd["state"]["a"]["step"] is step
        back = to_torch_state_dict(sd)
        assert back["param_groups"] == osd["param_groups"] and back["state"]["a"]["exp_avg"] is t
        # step comes back as a new 0-d tensor of the recorded dtype, bit for bit
        assert back["state"]["a"]["step"].dtype == torch.float32
        assert back["state"]["a"]["step"] is not step and same(back["state"]["a"]["step"], step)
    elif layout == "fsdp_dtensor":
        sd = {
            "state": {"a": {"exp_avg": t}},
            "param_to_group_meta": {
                "a": ((("lr", 0.1),), (("step", 4.0, "float32"),)),
                "b": ((("lr", 0.2),), ()),
                "c": ((("lr", 0.1),), ()),
            },
        }
        osd = to_torch_state_dict(sd)
        assert osd["param_groups"] == [
            {"lr": 0.1, "params": ["a", "c"]},
            {"lr": 0.2, "params": ["b"]},
        ]
        assert osd["state"]["a"]["exp_avg"] is t and same(osd["state"]["a"]["step"], step)
        assert from_torch_state_dict(osd) == sd
    else:  # 0.1.0's per-FQN dicts convert too
        sd = {
            "state": {"a": {"exp_avg": t, "step": step}},
            "param_to_group_meta": {"a": {"lr": 0.1}, "b": {"lr": 0.2}},
        }
        osd = to_torch_state_dict(sd)
        assert osd["param_groups"] == [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["b"]}]
        assert osd["state"]["a"]["step"] is step and osd["state"]["a"]["exp_avg"] is t
    with pytest.raises(ValueError, match="flattened"):
        from_torch_state_dict({"state": {"state.a.exp_avg": t}, "param_groups": []})


# ------------------------------------------------------------------------------------------
# save_checkpoint writes each rank's files without dcp.save's collectives and rank 0 writes
# .metadata itself: it must be DCP's, chunk for chunk, and plain dcp.load must read the files


def _chunks(md):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            out[key] = (tuple(m.size), p.dtype, p.layout, chunks)
        else:
            out[key] = type(m).__name__
    return out


def _rank_same_files_as_dcp(root, layout):
    from mfsdp_optim.checkpoint import safe_read_metadata, save_checkpoint

    m = Model(layout, "adamw")
    m.step(0)
    rank = torch.distributed.get_rank()
    sd = {
        "optimizer": build_sharded_state_dict(m.optimizer, m.records),
        "extra": {"scale": 2.0**16, "tag": "run-7", "table": torch.arange(40.0).view(5, 8)},
    }
    saved = global_state(sd["optimizer"])
    ours, stock = os.path.join(root, "ours"), os.path.join(root, "stock")
    save_checkpoint(sd, ours)
    dcp.save(sd, checkpoint_id=stock)
    torch.distributed.barrier()
    md_ours, md_stock = safe_read_metadata(ours), safe_read_metadata(stock)
    # every item written once: the storage entries are exactly the metadata's chunks
    entries = sorted(
        (i.fqn, tuple(i.offset) if i.offset is not None else None) for i in md_ours.storage_data
    )
    want = sorted(
        (k, tuple(c.offsets) if hasattr(m, "chunks") else None)
        for k, m in md_ours.state_dict_metadata.items()
        for c in (m.chunks if hasattr(m, "chunks") else [None])
    )
    files = sorted({s.relative_path for s in md_ours.storage_data.values()})
    # plain dcp.load (torch's own reader and planner) into fresh targets
    fresh = Model(layout, "adamw", lr_scale=5.0)
    target = {
        "optimizer": build_sharded_state_dict(fresh.optimizer, fresh.records, is_loading=True),
        "extra": {"scale": 0.0, "tag": "", "table": torch.zeros(5, 8)},
    }
    dcp.load(target, checkpoint_id=ours)
    load_sharded_state_dict(fresh.optimizer, fresh.records, target["optimizer"])
    loaded = global_state(build_sharded_state_dict(fresh.optimizer, fresh.records))
    return {
        "rank": rank,
        "same_chunks": _chunks(md_ours) == _chunks(md_stock),
        "same_mappings": md_ours.planner_data == md_stock.planner_data,
        "entries_match": entries == want,
        "files": files,
        "loads": same(loaded, saved),
        "extra": (target["extra"]["scale"], target["extra"]["tag"], target["extra"]["table"]),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["hsdp", "tp_fsdp"])
def test_save_checkpoint_writes_what_dcp_save_writes(ranks, tmp_path, layout):
    # 4 ranks: replicated mesh dimensions (each chunk written by one of its holders), a strided
    # shard, chunks empty on some ranks, plain tensors and objects (written by one rank)
    out = ranks(4).run(_rank_same_files_as_dcp, str(tmp_path), layout)
    for res in out:
        assert res["same_chunks"] and res["same_mappings"] and res["entries_match"], res
        assert res["loads"], res
        scale, tag, table = res["extra"]
        assert (
            scale == 2.0**16
            and tag == "run-7"
            and torch.equal(table, torch.arange(40.0).view(5, 8))
        )
    assert set(out[0]["files"]) <= {f"__{r}_0.distcp" for r in range(4)}, out[0]
