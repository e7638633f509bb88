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
from mfsdp_optim.checkpoint._table import TAG, VERSION, GroupMetaTable, as_table, is_table

STEPS = 2
H1 = (("betas", (0.9, 0.999)), ("lr", 0.01))
H2 = (("lr", 1),)
H3 = (("lr", 1.0),)  # equal to H2 by ==, but another type: must stay apart
S = (("step", 3.0, "float32"),)


def _table() -> GroupMetaTable:
    return GroupMetaTable.from_leaves(
        {"a.w": (H1, S), "a.b": (H1, S), "c": (H2, ()), "d": (H3, S), "e": (H1, ())}
    )


def test_table_reads_like_a_format2_dict():
    t = _table()
    want = {"a.w": (H1, S), "a.b": (H1, S), "c": (H2, ()), "d": (H3, S), "e": (H1, ())}
    assert not isinstance(t, Mapping)  # DCP must store it whole
    assert t["a.b"] == (H1, S) and t.get("nope") is None and t.get("c") == (H2, ())
    assert list(t) == list(t.keys()) == list(want) and len(t) == 5
    assert "d" in t and "x" not in t
    assert dict(t.items()) == want and list(t.values()) == list(want.values())
    assert t == want and t == GroupMetaTable.from_leaves(want) and t != {"a.w": (H1, S)}
    # distinct entries are held once; 1 and 1.0 are not merged
    assert t.hypers == (H1, H2, H3) and t.scalars == (S, ())
    assert type(t["c"][0][0][1]) is int and type(t["d"][0][0][1]) is float
    with pytest.raises(KeyError):
        t["nope"]
    with pytest.raises(TypeError):
        t["c"] = (H1, S)  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(t)


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
    # a fresh optimizer loads it: the target's table becomes the checkpoint's tagged tuple
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
        assert loaded == "tuple" and same and again, (rank, loaded, same, again)


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
    assert as_table(tagged)["layers.0.weight"][1] == (("step", 1.0, "float32"),)
