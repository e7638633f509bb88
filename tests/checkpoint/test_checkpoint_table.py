"""Format 3's ``param_to_group_meta``: one ``GroupMetaTable``, one DCP item, identical on every
rank, readable without this package."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
from _checkpoint_helpers import Model

from mfsdp_optim.checkpoint import build_sharded_state_dict, load_sharded_state_dict
from mfsdp_optim.checkpoint._state_dict._table import (
    TAG,
    VERSION,
    GroupMeta,
    GroupMetaTable,
    OptimizerStateDict,
    as_table,
    is_table,
)

STEPS = 2
H1 = (("betas", (0.9, 0.999)), ("lr", 0.01))
H2 = (("lr", 1),)
H3 = (("lr", 1.0),)  # equal to H2 by ==, but another type: must stay apart
S = (("step", 3.0, "float32"),)


def _table() -> GroupMetaTable:
    return GroupMetaTable.from_leaves(
        {"a.w": (H1, S), "a.b": (H1, S), "c": (H2, ()), "d": (H3, S), "e": (H1, ())}
    )


def test_table_reads_like_a_dict_of_read_only_mappings():
    t = _table()
    leaves = {"a.w": (H1, S), "a.b": (H1, S), "c": (H2, ()), "d": (H3, S), "e": (H1, ())}
    want = {
        fqn: {**dict(hyper), **{k: v for k, v, _ in scalars}}
        for fqn, (hyper, scalars) in leaves.items()
    }
    assert want["a.b"] == {"betas": (0.9, 0.999), "lr": 0.01, "step": 3.0}  # the reference
    assert not isinstance(t, Mapping)  # DCP must store it whole
    meta = t["a.b"]
    assert isinstance(meta, Mapping) and isinstance(meta, GroupMeta)
    assert meta["lr"] == 0.01 and meta["betas"] == (0.9, 0.999) and meta["step"] == 3.0
    assert sorted(meta.items()) == sorted(want["a.b"].items()) and dict(meta) == want["a.b"]
    assert meta == want["a.b"] and len(meta) == 3 and "lr" in meta and "params" not in meta
    assert meta.get("nope") is None and t.get("nope") is None and t.get("c") == {"lr": 1}
    assert t["a.w"] is t["a.b"]  # equal leaves share one read-only mapping
    assert list(t) == list(t.keys()) == list(want) and len(t) == 5
    assert "d" in t and "x" not in t
    assert {f: dict(m) for f, m in t.items()} == want
    assert [dict(m) for m in t.values()] == list(want.values())
    # the stored leaves, which the loaders read
    assert t.leaf("a.b") == (H1, S) and dict(t.leaves()) == leaves
    assert t == leaves and t == GroupMetaTable.from_leaves(leaves) and t != {"a.w": (H1, S)}
    assert t == dict(reversed(list(leaves.items())))  # FQN order aside, as dicts compare
    # distinct entries are held once; 1 and 1.0 are not merged
    assert t.hypers == (H1, H2, H3) and t.scalars == (S, ())
    assert type(t["c"]["lr"]) is int and type(t["d"]["lr"]) is float
    with pytest.raises(KeyError):
        t["nope"]
    with pytest.raises(KeyError):
        t.leaf("nope")
    with pytest.raises(TypeError):
        t["c"] = {"lr": 2}  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(t)
    _assert_read_only(meta)
    # a mapping pickles as a plain dict (readable anywhere, no longer read-only)
    assert type(pickle.loads(pickle.dumps(meta))) is dict
    assert pickle.loads(pickle.dumps(meta)) == want["a.b"]


def _assert_read_only(meta) -> None:
    before = dict(meta)
    with pytest.raises(TypeError):
        meta["lr"] = 0.5
    with pytest.raises(TypeError):
        del meta["lr"]
    with pytest.raises(TypeError):
        hash(meta)
    for name in ("update", "pop", "setdefault", "clear", "popitem"):
        assert not hasattr(meta, name), name
    assert dict(meta) == before


def test_scalar_state_key_shadows_a_group_key_of_the_same_name():
    # apex keeps a group-level "step": the mapping shows the param's own, the leaf keeps both
    t = GroupMetaTable.from_leaves({"w": ((("lr", 0.1), ("step", 7)), (("step", 3.0, None),))})
    assert dict(t["w"]) == {"lr": 0.1, "step": 3.0}
    assert t.leaf("w") == ((("lr", 0.1), ("step", 7)), (("step", 3.0, None),))


def test_tagged_tuple_round_trip():
    t = _table()
    tagged = pickle.loads(pickle.dumps(t))
    assert type(tagged) is tuple and tagged[:2] == (TAG, VERSION) and tagged == t.as_tuple()
    assert is_table(tagged) and is_table(t) and not is_table({"a": 1})
    back = as_table(tagged)
    assert back == t and back.fingerprint() == t.fingerprint()
    assert pickle.dumps(back) == pickle.dumps(t)
    with pytest.raises(ValueError, match="version 4"):
        as_table((TAG, 4, (), (), {}))
    with pytest.raises(ValueError, match="index entry 'x'"):
        as_table((TAG, VERSION, (H1,), (S,), {"x": (0, 1)}))
    with pytest.raises(ValueError, match="expected a GroupMetaTable"):
        as_table({"x": (H1, S)})


def test_tagged_tuple_unpickles_without_the_package():
    data = pickle.dumps(_table())
    code = (
        "import pickle, sys\n"
        "sys.modules['mfsdp_optim'] = None  # importing it would fail\n"
        "obj = pickle.loads(sys.stdin.buffer.read())\n"
        "assert type(obj) is tuple and obj[0] == 'mfsdp_optim.param_to_group_meta', obj\n"
        "assert 'mfsdp_optim' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
        "print(len(obj[4]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", code], input=data, capture_output=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == b"5", r.stderr.decode()


def _one_item(root, filter_empty):
    """4 ranks, uneven shards ("tiny" empty on ranks 2,3, "layers.1.bias" on 3)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from mfsdp_optim.checkpoint import safe_read_metadata

    m = Model("fsdp", "adamw", filter_empty=filter_empty)
    for t in range(STEPS):
        m.step(t)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    table = sd["param_to_group_meta"]
    assert isinstance(table, GroupMetaTable)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (table.as_tuple(), pickle.dumps(table)))
    path = os.path.join(root, f"filter{int(filter_empty)}")
    dcp.save({"optimizer": sd}, checkpoint_id=path)
    md = safe_read_metadata(path).state_dict_metadata
    tensors = sum(len(e) for e in sd["state"].values())
    kinds = {k: isinstance(v, BytesStorageMetadata) for k, v in md.items()}
    # a fresh optimizer loads it: DCP stores the checkpoint's tagged tuple, the target's dict
    # (an OptimizerStateDict) turns it back into a table
    fresh = Model("fsdp", "adamw", filter_empty=filter_empty)
    target = build_sharded_state_dict(fresh.optimizer, fresh.records, is_loading=True)
    dcp.load({"optimizer": target}, checkpoint_id=path)
    loaded = target["param_to_group_meta"]
    load_sharded_state_dict(fresh.optimizer, fresh.records, target)
    again = build_sharded_state_dict(fresh.optimizer, fresh.records)
    return (
        everyone,
        len(md),
        tensors,
        kinds,
        type(loaded).__name__,
        as_table(loaded) == table,
        again["param_to_group_meta"] == table,
        [r.fqn for r in m.records if r.opt_param is None],
    )


@pytest.mark.parametrize("filter_empty", [True, False])
def test_table_is_one_item_identical_on_every_rank(ranks, tmp_path, filter_empty):
    out = ranks(4).run(_one_item, str(tmp_path), filter_empty)
    first = out[0][0][0]
    for rank, (everyone, items, tensors, kinds, loaded, same, again, filtered) in enumerate(out):
        if filter_empty and rank >= 2:
            assert filtered, "precondition: the empty-shard filter dropped params here"
        # identical on every rank, value and pickled bytes (DCP keeps ONE copy)
        assert all(e == first for e in everyone), f"rank {rank}: tables differ between ranks"
        assert len(as_table(first[0])) == 5, "the table covers every param"
        # .metadata: every state tensor plus ONE non-tensor item, the table
        assert items == tensors + 1, (items, tensors)
        assert [k for k, b in kinds.items() if b] == ["optimizer.param_to_group_meta"]
        assert loaded == "GroupMetaTable" and same and again, (rank, loaded, same, again)


def _stock_reads(root):
    import torch.distributed.checkpoint as dcp

    m = Model("fsdp", "adam")
    m.step(0)
    path = os.path.join(root, "ckpt")
    dcp.save({"optimizer": build_sharded_state_dict(m.optimizer, m.records)}, checkpoint_id=path)
    return path


def test_stock_format_utils_reads_the_table(ranks, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = ranks(2).run(_stock_reads, str(tmp_path))[0]
    out = str(tmp_path / "full.pt")
    dcp_to_torch_save(path, out)
    full = torch.load(out, weights_only=False)
    tagged = full["optimizer"]["param_to_group_meta"]
    assert type(tagged) is tuple and tagged[0] == TAG and len(as_table(tagged)) == 5
    assert as_table(tagged).leaf("layers.0.weight")[1] == (("step", 1.0, "float32"),)
    assert as_table(tagged)["layers.0.weight"]["step"] == 1.0


def test_state_dict_turns_the_loaded_tuple_back_into_a_table():
    t = _table()
    sd = OptimizerStateDict(state={}, param_to_group_meta=t)
    sd["param_to_group_meta"] = pickle.loads(pickle.dumps(t))  # what dcp.load stores
    assert isinstance(sd["param_to_group_meta"], GroupMetaTable) and sd["param_to_group_meta"] == t
    assert sd["param_to_group_meta"]["a.b"]["lr"] == 0.01
    bad = (TAG, VERSION, (H1,), (S,), {"x": (0, 1)})  # index out of range: kept as read
    sd["param_to_group_meta"] = bad
    assert sd["param_to_group_meta"] is bad
    sd["other"] = t.as_tuple()  # only param_to_group_meta is a table
    assert type(sd["other"]) is tuple


def _reference_meta(m) -> dict:
    """{fqn: {hyperparameter: value}} read straight from the base optimizer: its group's keys
    but "params", and the param's step as a number (no checkpoint code involved)."""
    out = {}
    for r in m.records:
        group = next(
            g for g in m.optimizer.param_groups if any(p is r.opt_param for p in g["params"])
        )
        meta = {k: v for k, v in group.items() if k != "params"}
        meta["step"] = float(m.optimizer.state[r.opt_param]["step"])
        out[r.fqn] = meta
    return out


def _meta_of(sd) -> dict:
    """What a Megatron-style reader sees: per FQN, the mapping's type, meta["lr"], items(),
    dict(), and whether assignment raised TypeError (the mapping left unchanged)."""
    out = {}
    for fqn in sd["param_to_group_meta"]:
        meta = sd["param_to_group_meta"][fqn]
        try:
            meta["lr"] = -1.0
            refused = False
        except TypeError:
            refused = meta["lr"] != -1.0
        out[fqn] = (type(meta).__name__, meta["lr"], sorted(meta.items()), dict(meta), refused)
    return out


def _meta_round_trip(root):
    """2 ranks: the table's mappings in memory, then after a real dcp.save and, into targets
    whose lr differs, dcp.load (nested and top-level) and load_checkpoint."""
    import torch.distributed.checkpoint as dcp

    from mfsdp_optim.checkpoint import load_checkpoint

    m = Model("fsdp", "adamw", filter_empty=False)
    for t in range(STEPS):
        m.step(t)
    ref = _reference_meta(m)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    out = {"memory": _meta_of(sd)}
    nested, top = os.path.join(root, "nested"), os.path.join(root, "top")
    dcp.save({"optimizer": sd}, checkpoint_id=nested)
    dcp.save(sd, checkpoint_id=top)

    def target():
        fresh = Model("fsdp", "adamw", filter_empty=False, lr_scale=3.0)
        return build_sharded_state_dict(fresh.optimizer, fresh.records, is_loading=True)

    a = target()
    dcp.load({"optimizer": a}, checkpoint_id=nested)
    out["dcp.load nested"] = _meta_of(a)
    b = target()
    dcp.load(b, checkpoint_id=top)
    out["dcp.load top-level"] = _meta_of(b)
    c = target()
    load_checkpoint({"optimizer": c}, nested, require_marker=False)
    out["load_checkpoint"] = _meta_of(c)
    return ref, out


def test_meta_is_a_read_only_mapping_before_and_after_dcp(ranks, tmp_path):
    results = ranks(2).run(_meta_round_trip, str(tmp_path))
    for rank, (ref, out) in enumerate(results):
        assert set(ref) == {
            "layers.0.weight",
            "layers.0.bias",
            "layers.1.weight",
            "tiny",
            "layers.1.bias",
        }
        assert ref["layers.0.bias"]["lr"] == 0.005 and ref["layers.0.weight"]["step"] == STEPS
        assert list(out) == ["memory", "dcp.load nested", "dcp.load top-level", "load_checkpoint"]
        for how, metas in out.items():
            assert set(metas) == set(ref), (rank, how)
            for fqn, (kind, lr, items, as_dict, refused) in metas.items():
                where = (rank, how, fqn)
                assert kind == "GroupMeta" and refused, where
                assert lr == ref[fqn]["lr"] and as_dict == ref[fqn], (where, as_dict, ref[fqn])
                assert items == sorted(ref[fqn].items()), where
