"""The demo's expert-parallel layer keeps at most one functional collective in flight, and its
experts are a module that every supported torch's ``fully_shard`` takes.

On gloo (torch 2.13.0+cpu), two functional collectives in flight on one group corrupt the heap:
a rank later dies of SIGSEGV or a glibc abort (docs/troubleshooting.md, "A CPU rank dies";
``scripts/gloo_funcol_repro.py`` shows it within seconds, with no code of this package). The
demo's ``MoE.forward`` used to issue its two all-gathers before waiting for either, and the demo
test failed about once in forty runs. That rate is too low for a test to catch, so this one
checks the cause directly: right after each collective the layer issues, torch's registry of
unwaited functional collectives holds exactly that one, and nothing is left after backward.
"""

from __future__ import annotations

import os
import sys

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"
)


def _in_flight_through_moe() -> tuple[list[tuple[str, int]], int, float]:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _get_work_registry_size

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import _moe

    rank = dist.get_rank()
    seen: list[tuple[str, int]] = []
    names = ("_all_gather", "_all_gather_ad", "_reduce_scatter_ad")
    originals = {name: getattr(_moe, name) for name in names}

    def watched(name, fn):
        def issue(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.append((name, _get_work_registry_size()))
            return out

        return issue

    try:
        for name, fn in originals.items():
            setattr(_moe, name, watched(name, fn))
        cfg = _moe.ModelConfig()
        layer = _moe.MoE(cfg, rank, dist.get_world_size(), dist.group.WORLD, seed=0)
        x = torch.randn(2, cfg.seq, cfg.dim, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_(True)
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
    finally:
        for name, fn in originals.items():
            setattr(_moe, name, fn)
    return seen, _get_work_registry_size(), float(x.grad.abs().sum())


def test_moe_layer_keeps_one_functional_collective_in_flight(ranks):
    results = ranks(2).run(_in_flight_through_moe, timeout=60.0)
    for rank, (seen, left, grad_sum) in enumerate(results):
        # forward: all-gather of the tokens, of the expert indices, reduce-scatter of the outputs
        assert [name for name, _ in seen] == ["_all_gather_ad", "_all_gather", "_reduce_scatter_ad"]
        assert all(count == 1 for _, count in seen), (rank, seen)
        assert left == 0, (rank, left)
        assert grad_sum > 0.0  # backward went through both collectives' backward passes


def test_the_experts_fully_shard_takes_on_every_torch():
    """torch 2.11's ``fully_shard`` refuses every ``nn.ModuleList`` / ``nn.ModuleDict`` (2.13 only
    those without a ``forward``), so the module the demo shards per expert group is neither, on
    any torch; its children keep the global expert ids in the FQNs (checkpoints reshard by them)."""
    import torch.nn as nn

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import _moe

    layer = _moe.MoE(_moe.ModelConfig(), ep_rank=1, ep_size=2, ep_group=None, seed=0)
    assert not isinstance(layer.experts, (nn.ModuleList, nn.ModuleDict))
    names = [n for n, _ in layer.named_parameters() if n.startswith("experts.")]
    assert names[0] == "experts.2.fc1.weight" and names[-1] == "experts.3.fc2.bias", names
