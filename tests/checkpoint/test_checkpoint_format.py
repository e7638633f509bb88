"""Checkpoint formats: the checked-in 0.1.0 checkpoint (tests/data/ckpt_v0_1_0, see _v010.py) and
the format-2 and format-3 ones (tests/data/ckpt_format2 and ckpt_format3, see _format2.py and
_format3.py) still load bit for bit, on their own world size and resharded."""

from __future__ import annotations

import os

import pytest
import torch
from _checkpoint_helpers import DATA, same
from _v010 import GROUPS, STEPS, sharded_model, train, train_sharded

from mfsdp_optim.checkpoint import (
    build_sharded_state_dict,
    load_checkpoint,
    load_sharded_state_dict,
    prune_to_checkpoint,
)

V010 = os.path.join(DATA, "ckpt_v0_1_0")
FORMAT2 = os.path.join(DATA, "ckpt_format2")
FORMAT3 = os.path.join(DATA, "ckpt_format3")


def _full(optimizer, records) -> dict:
    """{fqn: {key: full tensor}} of the live optimizer (collective: full_tensor)."""
    out = {}
    for r in records:
        live = optimizer.state.get(r.param)
        if live:
            out[r.fqn] = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone())
                for k, v in sorted(live.items())
            }
    return out


def _recompute():
    """The state the 0.1.0 save held, recomputed now on the same world size (2 ranks)."""
    records, opt = sharded_model()
    train_sharded(records, opt)
    return _full(opt, records)


def _load_v010(path, via):
    records, opt = sharded_model()
    for g in opt.param_groups:
        g["lr"] = 123.0  # the load must restore the saved hyperparameters
    target = build_sharded_state_dict(opt, records, is_loading=True)
    target = prune_to_checkpoint(target, path)  # "frozen" had no state when saved
    if via == "load_checkpoint":
        load_checkpoint({"optimizer": target}, path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load({"optimizer": target}, checkpoint_id=path)
    load_sharded_state_dict(opt, records, target)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return _full(opt, records), groups


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fixture", ["v0_1_0", "format2", "format3"])
def test_checked_in_checkpoint_loads_bit_for_bit(ranks, world, fixture):
    path = {"v0_1_0": V010, "format2": FORMAT2, "format3": FORMAT3}[fixture]
    want = ranks(2).run(_recompute)[0]
    ref, ref_hyper = train()
    # precondition: the recomputation is the training the checkpoint holds (float32 rounding
    # apart, sharded against unsharded), and "frozen" really has no state
    assert set(want) == set(ref) == {"enc.weight", "enc.bias", "head.weight"}
    for fqn in ref:
        for k in ref[fqn]:
            assert torch.allclose(want[fqn][k], ref[fqn][k], rtol=1e-6, atol=1e-7), (fqn, k)
    assert float(want["enc.weight"]["step"]) == STEPS
    for via in ("load_checkpoint", "dcp.load"):
        out = ranks(world).run(_load_v010, path, via)
        for state, groups in out:
            assert same(state, want), f"{via} on {world} ranks"
            for g, saved in zip(groups, GROUPS, strict=True):
                assert all(g[k] == v for k, v in saved.items()), (g, saved)
            assert groups[0] == {k: v for k, v in ref_hyper["enc.weight"].items()}


def _format3_meta(path):
    """The checked-in format-3 checkpoint through dcp.load and load_checkpoint into targets
    whose lr differs: per FQN, the type of ``[fqn]``, ``dict(meta)``, and whether assignment
    raised TypeError."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for via in ("dcp.load", "load_checkpoint"):
        records, opt = sharded_model()
        for g in opt.param_groups:
            g["lr"] = 123.0
        target = prune_to_checkpoint(build_sharded_state_dict(opt, records, is_loading=True), path)
        if via == "dcp.load":
            dcp.load({"optimizer": target}, checkpoint_id=path)
        else:
            load_checkpoint({"optimizer": target}, path)
        metas = {}
        for fqn, meta in target["param_to_group_meta"].items():
            with pytest.raises(TypeError):
                meta["lr"] = 0.0
            metas[fqn] = (type(meta).__name__, dict(meta), meta["lr"])
        out[via] = metas
    return out


def test_checked_in_format3_meta_reads_as_mappings_after_a_load(ranks):
    _, ref_hyper = train()  # the independent reference: one process, plain tensors
    for got in ranks(2).run(_format3_meta, FORMAT3):
        for via, metas in got.items():
            assert set(metas) == set(ref_hyper), (via, set(metas))
            for fqn, (kind, meta, lr) in metas.items():
                assert kind == "GroupMeta" and lr == ref_hyper[fqn]["lr"] != 123.0, (via, fqn)
                # the saved group keys (those of the torch that wrote it) hold the saved values
                hyper = {k: v for k, v in meta.items() if k != "step"}
                assert all(hyper[k] == ref_hyper[fqn][k] for k in hyper), (via, fqn, hyper)
                assert {"lr", "betas", "eps", "weight_decay"} <= set(hyper), (via, fqn)
                if fqn == "frozen":  # never stepped: no scalar state
                    assert "step" not in meta, (via, meta)
                else:
                    assert meta["step"] == STEPS, (via, fqn, meta)
