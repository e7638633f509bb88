"""Whole-param optimizers' state through real DCP files: Adafactor's factored second moments
(``row_var`` / ``col_var``, not shaped like their params: Replicate DTensors on the param's mesh)
and Muon's ``momentum_buffer`` (parameter-shaped), trained under the wrapper on 4 ranks, saved
with ``sharded_state_dict()``, loaded on 2 ranks (and 2x2 HSDP) and continued. Reference: the
same classes on the unsharded params fed the sharded run's global grads (``full_tensor()``),
compared bit for bit; the resumed run against the uninterrupted one with a tolerance (the
reductions differ with the world size). A wrong-shaped factor raises StateDictMismatchError on
every rank and changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _models import _batch, _model, _shard

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _bases(opt_name: str, named: list[tuple[str, torch.Tensor]]) -> list[torch.optim.Optimizer]:
    """The base optimizers over ``named`` params (DTensors under the wrapper, or the reference's
    plain full tensors): Adafactor over all, or Muon over the matrices + AdamW over the rest."""
    if opt_name == "adafactor":
        return [torch.optim.Adafactor([p for _, p in named], lr=0.01, weight_decay=0.01)]
    matrices = [p for _, p in named if p.dim() == 2]
    rest = [p for _, p in named if p.dim() != 2]
    return [
        torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1),
    ]


def _wrapped(mesh, opt_name: str, filter_empty: bool = False):
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    model = _model(0)
    _shard(model, mesh)
    opt = FullyShardedOptimizer(
        _bases(opt_name, list(model.named_parameters())),
        OptimizerConfig(filter_empty_shards=filter_empty),
        model_chunks=[model],
    )
    return model, opt


def _reference(model, opt, opt_name: str):
    """Plain full copies of the params and the same classes over them, with the live state of
    the wrapper's base optimizers as full tensors (every rank builds the same one)."""
    from torch.distributed.tensor import DTensor

    named = [(n, p.detach().full_tensor().clone()) for n, p in model.named_parameters()]
    ref = _bases(opt_name, named)
    full = dict(named)
    for base, rbase in zip(opt.optimizers, ref, strict=True):
        for n, p in model.named_parameters():
            st = base.state.get(p)
            if not st:
                continue
            rbase.state[full[n]] = {
                k: (
                    v.full_tensor().clone()
                    if isinstance(v, DTensor)
                    else v.clone()
                    if isinstance(v, torch.Tensor)
                    else v
                )
                for k, v in st.items()
            }
    return full, ref


def _train(model, opt, full, ref, steps: int, first: int) -> None:
    """``steps`` wrapper steps; the reference steps on the same global grads."""
    for step in range(first, first + steps):
        model(_batch(step)).pow(2).mean().backward()
        for n, p in model.named_parameters():
            full[n].grad = p.grad.full_tensor().clone()
        ok, _, _ = opt.step()
        assert ok
        opt.zero_grad()
        for r in ref:
            r.step()
            r.zero_grad()


def _check_against(model, opt, full, ref) -> None:
    """Params and every state entry of the wrapper equal the reference's, bit for bit."""
    from torch.distributed.tensor import DTensor

    for n, p in model.named_parameters():
        got = p.detach().full_tensor()
        assert torch.equal(got, full[n]), f"param {n} differs from the unsharded reference"
    for base, rbase in zip(opt.optimizers, ref, strict=True):
        for n, p in model.named_parameters():
            st = base.state.get(p)
            if st is None:
                continue
            rst = rbase.state[full[n]]
            assert sorted(st) == sorted(rst), n
            for k, v in st.items():
                g = v.full_tensor() if isinstance(v, DTensor) else v
                assert torch.equal(torch.as_tensor(g), torch.as_tensor(rst[k])), f"{n}[{k}]"


def _global(opt) -> dict:
    from _checkpoint_helpers import global_state

    state, meta = global_state(opt.sharded_state_dict())
    flat = {
        f"{fqn}.{key}": torch.as_tensor(value).detach().clone()
        for fqn, entry in state.items()
        for key, value in entry.items()
    }
    return flat, meta


def _rank_save(path, opt_name, filter_empty):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), opt_name, filter_empty)
    full, ref = _reference(model, opt, opt_name)
    _train(model, opt, full, ref, STEPS_BEFORE, 0)
    _check_against(model, opt, full, ref)
    sd = opt.sharded_state_dict()
    layouts = {
        f"{fqn}.{k}": (tuple(v.shape), tuple(map(repr, v.placements)))
        for fqn, entry in sd["state"].items()
        for k, v in entry.items()
    }
    dcp.save({"model": get_model_state_dict(model), "optimizer": sd}, checkpoint_id=path)
    state, meta = _global(opt)
    _train(model, opt, full, ref, STEPS_AFTER, STEPS_BEFORE)
    _check_against(model, opt, full, ref)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return layouts, state, meta, params


def _load_target(path, mesh_shape, opt_name, filter_empty):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, opt = _wrapped(get_mesh(mesh_shape), opt_name, filter_empty)
    target = {
        "model": get_model_state_dict(model),
        "optimizer": opt.sharded_state_dict(is_loading=True),
    }
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(model, target["model"])
    return model, opt, target["optimizer"]


def _rank_load(path, mesh_shape, opt_name, filter_empty):
    model, opt, sd = _load_target(path, mesh_shape, opt_name, filter_empty)
    opt.load_state_dict(sd)
    state, meta = _global(opt)
    full, ref = _reference(model, opt, opt_name)
    _train(model, opt, full, ref, STEPS_AFTER, STEPS_BEFORE)
    _check_against(model, opt, full, ref)
    params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return state, meta, params


@pytest.mark.parametrize(
    "opt_name,load_mesh,filter_empty",
    [
        ("adafactor", (2,), False),
        ("adafactor", (2, 2), True),
        ("muon", (2,), False),
    ],
    ids=["adafactor-fsdp2", "adafactor-hsdp2x2-filtered", "muon+adamw-fsdp2"],
)
def test_save_on_4_load_elsewhere_and_continue(ranks, tmp_path, opt_name, load_mesh, filter_empty):
    path = str(tmp_path / "ckpt")
    saved = ranks(4).run(_rank_save, path, opt_name, filter_empty)
    layouts, state0, meta0, params0 = saved[0]
    assert all(s[0] == layouts for s in saved)  # every rank emits the same keys and layouts
    if opt_name == "adafactor":
        # the factors are saved in their own shapes, Replicate on the param's mesh
        assert layouts["0.weight.row_var"] == ((5, 1), ("Replicate()",))
        assert layouts["0.weight.col_var"] == ((1, 6), ("Replicate()",))
        assert layouts["0.bias.variance"] == ((5,), ("Shard(dim=0)",))
        assert "0.weight.variance" not in layouts
        assert {k.rsplit(".", 1)[1] for k in state0} == {"row_var", "col_var", "variance", "step"}
    else:
        assert layouts["0.weight.momentum_buffer"] == ((5, 6), ("Shard(dim=0)",))
        assert "0.bias.exp_avg_sq" in layouts
    world = 1
    for n in load_mesh:
        world *= n
    loaded = ranks(world).run(_rank_load, path, load_mesh, opt_name, filter_empty)
    for state, meta, params in loaded:
        assert meta == meta0
        assert sorted(state) == sorted(state0)
        for key, value in state0.items():
            assert torch.equal(state[key], value), f"{key} differs after the reshard"
        # the resumed run follows the uninterrupted one (other reductions: a tolerance)
        for name, p in params.items():
            torch.testing.assert_close(p, params0[name], rtol=1e-5, atol=1e-6)


def _rank_mismatch(path):
    from _checkpoint_helpers import same
    from torch.distributed.tensor import DTensor, Replicate

    from mfsdp_optim.checkpoint import StateDictMismatchError

    model, opt, sd = _load_target(path, (2,), "adafactor", False)
    base = opt.optimizers[0]
    before = [
        {k: (v._local_tensor.clone() if isinstance(v, DTensor) else v) for k, v in st.items()}
        for st in base.state.values()
    ]
    groups = [dict(g, params=None) for g in base.param_groups]
    if dist.get_rank() == 1:  # one rank's factor has a wrong global shape
        mesh = model[0].weight.device_mesh
        sd["state"]["0.weight"]["row_var"] = DTensor.from_local(
            torch.zeros(6, 1), mesh, [Replicate()], run_check=False
        )
    with pytest.raises(StateDictMismatchError) as err:
        opt.load_state_dict(sd)
    after = [
        {k: (v._local_tensor.clone() if isinstance(v, DTensor) else v) for k, v in st.items()}
        for st in base.state.values()
    ]
    assert same(before, after)
    assert [dict(g, params=None) for g in base.param_groups] == groups
    return str(err.value)


def test_wrong_shaped_factor_raises_on_every_rank_and_changes_nothing(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks(4).run(_rank_save, path, "adafactor", False)
    messages = ranks(2).run(_rank_mismatch, path)
    for message in messages:
        assert "'0.weight'" in message and "'row_var'" in message, message
        assert "global shape (6, 1), expected (5, 1)" in message, message
        assert "rank 1" in message, message


def _rank_without_state(path):
    """Rank 3 describes no state (as a rank whose optimizer dropped the params would): it saves
    no own-layout value (a peer writes the Replicate chunk) and, loading, emits placeholders of
    the factors' own global shape and placements that dcp.load fills."""
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh

    from mfsdp_optim.checkpoint import ParamRecord, build_sharded_state_dict

    model, opt = _wrapped(get_mesh((4,)), "adafactor")
    full, ref = _reference(model, opt, "adafactor")
    _train(model, opt, full, ref, STEPS_BEFORE, 0)
    base, rank = opt.optimizers[0], dist.get_rank()
    records = [ParamRecord(n, p, None if rank == 3 else p) for n, p in model.named_parameters()]
    sd = build_sharded_state_dict(base, records)
    saved_keys = {fqn: sorted(e) for fqn, e in sd["state"].items()}
    dcp.save({"optimizer": sd}, checkpoint_id=path)
    target = build_sharded_state_dict(base, records, is_loading=True)
    for entry in target["state"].values():
        for v in entry.values():
            v._local_tensor.fill_(float("nan"))  # only dcp.load can make these right
    dcp.load({"optimizer": target}, checkpoint_id=path)
    got = {}
    for fqn, entry in target["state"].items():
        rstate = ref[0].state[full[fqn]]
        for k, v in entry.items():
            got[f"{fqn}.{k}"] = (tuple(v.shape), tuple(map(repr, v.placements)))
            assert torch.equal(v.full_tensor(), rstate[k]), f"{fqn}[{k}] after the load"
    return saved_keys, got


def test_rank_without_state_saves_no_factor_and_loads_into_placeholders(ranks, tmp_path):
    results = ranks(4).run(_rank_without_state, str(tmp_path / "ckpt"))
    saved_keys, got = results[3]
    assert "0.weight" not in saved_keys  # its factors only: none saved from rank 3
    assert "0.bias" in saved_keys and saved_keys["0.bias"] == ["variance"]  # "t": placeholder
    assert got["0.weight.row_var"] == ((5, 1), ("Replicate()",))
    assert got["0.weight.col_var"] == ((1, 6), ("Replicate()",))
    assert all(r[1] == got for r in results)  # every rank loads the same keys and layouts
    assert results[0][0]["0.weight"] == ["col_var", "row_var"]


def _rank_stock_save(path):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), "adafactor")
    full, ref = _reference(model, opt, "adafactor")
    _train(model, opt, full, ref, STEPS_BEFORE, 0)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt.optimizers)}, checkpoint_id=path)
    return _global(opt)[0]


def _rank_stock_load(path):
    import torch.distributed.checkpoint as dcp
    from _layouts import get_mesh
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), "adafactor")
    full, ref = _reference(model, opt, "adafactor")
    _train(model, opt, full, ref, 1, 0)  # the stock helpers load into existing state
    target = {"optimizer": get_optimizer_state_dict(model, opt.optimizers)}
    dcp.load(target, checkpoint_id=path)
    set_optimizer_state_dict(model, opt.optimizers, target["optimizer"])
    return _global(opt)[0]


def test_stock_helpers_carry_the_factors_from_4_to_2_ranks(ranks, tmp_path):
    """torch's own get_/set_optimizer_state_dict over the wrapper's Adafactor (its factors are
    Replicate DTensors on the param's mesh): saved on 4 ranks, loaded on 2, bit for bit."""
    path = str(tmp_path / "stock")
    saved = ranks(4).run(_rank_stock_save, path)[0]
    assert any(k.endswith(".row_var") for k in saved) and any(k.endswith(".col_var") for k in saved)
    for loaded in ranks(2).run(_rank_stock_load, path):
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"{key} differs after the stock round trip"


def _rank_save_checkpoint(path):
    from _layouts import get_mesh

    from mfsdp_optim.checkpoint import save_checkpoint

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), "adafactor")
    full, ref = _reference(model, opt, "adafactor")
    _train(model, opt, full, ref, STEPS_BEFORE, 0)
    save_checkpoint({"optimizer": opt.sharded_state_dict()}, path)


def _edit_chunk(src, dst, key, offsets=None, sizes=None):
    """Copy the checkpoint ``src`` to ``dst`` with ``key``'s one chunk moved to ``offsets`` or
    resized to ``sizes`` in ``.metadata``, and the marker and checksums rewritten to match (so
    every integrity check passes): what a careful hand edit leaves."""
    import dataclasses
    import hashlib
    import json
    import os
    import pickle
    import shutil

    shutil.copytree(src, dst)
    meta_path = os.path.join(dst, ".metadata")
    with open(meta_path, "rb") as f:
        md = pickle.load(f)  # noqa: S301 - our own test file
    (chunk,) = md.state_dict_metadata[key].chunks
    old_offsets = chunk.offsets
    chunk.offsets = torch.Size(offsets) if offsets is not None else chunk.offsets
    chunk.sizes = torch.Size(sizes) if sizes is not None else chunk.sizes
    for index in list(md.storage_data):
        if index.fqn == key and index.offset == old_offsets:
            info = md.storage_data.pop(index)
            md.storage_data[dataclasses.replace(index, offset=chunk.offsets)] = info
    with open(meta_path, "wb") as f:
        pickle.dump(md, f)
    sums_path = os.path.join(dst, "mfsdp_checksums.json")
    with open(sums_path) as f:
        sums = json.load(f)
    for item in sums["items"]:
        if item["key"] == key:
            item["chunk"] = list(chunk.offsets)
    with open(sums_path, "w") as f:
        json.dump(sums, f)
    marker_path = os.path.join(dst, "mfsdp_complete.json")
    with open(marker_path) as f:
        marker = json.load(f)
    for name in (".metadata", "mfsdp_checksums.json"):
        marker["files"][name] = os.path.getsize(os.path.join(dst, name))
    with open(meta_path, "rb") as f:
        marker["metadata_sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def _rank_load_edited(path):
    from _checkpoint_helpers import same
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor

    from mfsdp_optim.checkpoint import CorruptCheckpointError, load_checkpoint

    model, opt = _wrapped(get_mesh((dist.get_world_size(),)), "adafactor")
    full, ref = _reference(model, opt, "adafactor")
    _train(model, opt, full, ref, 1, 5)  # live state unlike the saved one
    base = opt.optimizers[0]

    def live():
        return [
            {k: (v._local_tensor.clone() if isinstance(v, DTensor) else v) for k, v in st.items()}
            for st in base.state.values()
        ]

    before = live()
    target = {"optimizer": opt.sharded_state_dict(is_loading=True)}
    try:
        load_checkpoint(target, path)
        opt.load_state_dict(target["optimizer"])
    except CorruptCheckpointError as exc:
        assert same(live(), before), "a refused load changed the optimizer"
        return str(exc)
    return None


@pytest.mark.parametrize(
    "edit",
    [{"offsets": (2, 0)}, {"sizes": (3, 1)}, {"offsets": (0, 0), "sizes": (5, 1)}],
    ids=["offset", "size", "control"],
)
def test_factor_chunk_rewritten_in_metadata_is_refused(ranks, tmp_path, edit):
    """Issue 35, item 6: a factored entry's chunk moved in ``.metadata`` (marker and checksums
    rewritten to match) loaded live rows followed by saved rows; now refused on every rank with
    nothing changed. The control rewrites the chunk as it was and loads."""
    src, dst = str(tmp_path / "ckpt"), str(tmp_path / "edited")
    pool = ranks(2)
    pool.run(_rank_save_checkpoint, src)
    _edit_chunk(src, dst, "optimizer.state.0.weight.row_var", **edit)
    for msg in pool.run(_rank_load_edited, dst):
        if "sizes" in edit and "offsets" in edit:
            assert msg is None, msg
            continue
        assert msg is not None, "the edited checkpoint loaded"
        assert "'optimizer.state.0.weight.row_var'" in msg and "do not tile" in msg, msg
        assert "nothing was loaded" in msg, msg


def test_chunk_tiling_check_finds_holes_overlaps_and_strays():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from mfsdp_optim.checkpoint._on_disk._load_checkpoint import _tiling_problem

    def chunks(*boxes):
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]

    shape = (8, 4)
    assert _tiling_problem(shape, chunks(((0, 0), (4, 4)), ((4, 0), (4, 4)))) == ""
    assert _tiling_problem(shape, chunks(((0, 0), (8, 2)), ((0, 2), (8, 2)))) == ""
    assert _tiling_problem((), chunks(((), ()))) == ""
    assert _tiling_problem((0, 4), chunks(((0, 0), (0, 4)), ((0, 0), (0, 4)))) == ""
    # equal volume, but overlapping and leaving a hole: rows 2..3 twice, rows 6..7 never
    assert "overlap" in _tiling_problem(shape, chunks(((0, 0), (4, 4)), ((2, 0), (4, 4))))
    assert "outside" in _tiling_problem(shape, chunks(((0, 0), (4, 4)), ((6, 0), (4, 4))))
    assert "elements" in _tiling_problem(shape, chunks(((0, 0), (4, 4))))
    assert "dims" in _tiling_problem(shape, chunks(((0,), (8,))))
