"""``mfsdp_optim.checkpoint.seam``: the names the wrapper layer and the benchmarks use are the
layer's own objects, and the benchmarks' readings say what they claim (one process, no group).
"""

from __future__ import annotations

import torch

import mfsdp_optim.checkpoint as checkpoint
from mfsdp_optim.checkpoint import ParamRecord, prepare_async_save, seam


def test_the_wrapper_layer_names_are_the_layers_objects():
    for name in ("GroupMetaTable", "OptimizerStateDict", "load_sharded_state_dicts"):
        assert getattr(seam, name) is getattr(checkpoint, name), name
    assert sorted(seam.__all__) == seam.__all__


def test_host_buffer_bytes_follow_a_preparation_and_a_release():
    state = {"optimizer": {"state": {"w": {"exp_avg": torch.zeros(64, dtype=torch.float32)}}}}
    seam.release_host_buffers()
    assert seam.host_buffer_bytes() == 0
    prepare_async_save(state, background=False).wait()
    assert seam.host_buffer_bytes() == 64 * 4
    seam.release_host_buffers()
    assert seam.host_buffer_bytes() == 0


def test_describe_state_lists_every_held_param_and_its_group():
    w, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    local = seam.describe_state(opt, [ParamRecord("w", w, w), ParamRecord("b", b, b)])
    description = local.description
    assert set(description["fqns"]) == {"w", "b"}
    assert description["fqns"]["w"][1] != description["fqns"]["b"][1]  # two groups
    assert description["errors"] == []
    lrs = [dict(m)["lr"] for m in description["metas"]]
    assert sorted(lrs) == [0.1, 0.2]


def test_collective_bytes_sent_counts_nothing_without_a_collective():
    before = seam.collective_bytes_sent()
    assert isinstance(before, int) and before >= 0
    seam.describe_state(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), [])
    assert seam.collective_bytes_sent() == before
