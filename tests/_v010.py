"""The small optimizer checkpoint checked in under ``tests/data/ckpt_v0_1_0``, and how it was made.

It was written by mfsdp_optim 0.1.0's ``build_sharded_state_dict`` + ``save_checkpoint`` (the
fsdp_dtensor layout with one dict of hyperparameters per FQN and one ``step`` tensor per param) on 2
gloo CPU ranks, before the layout changed. ``tests/checkpoint/test_checkpoint_format.py`` loads it
with the current code and compares against :func:`train`, which recomputes the same state in one
process from the same deterministic data (an independent reference: no file of ours is read for it).

Model: four DTensor params sharded ``Shard(0)`` over a 1-D mesh of the world, their base optimizer
an Adam over the DTensors themselves (the wrapper's transparent case) with two param groups
(``lr`` 0.01 and 0.005, ``betas`` (0.8, 0.9) on the second), two steps, and ``"frozen"`` never
given a grad, so it has no state. Regenerate (only to reproduce the history; the point of the
fixture is that it is NOT regenerated)::

    PYTHONPATH=src python tests/_v010.py tests/data/ckpt_v0_1_0
"""

from __future__ import annotations

import os
import sys

import torch

# name, global shape, group
PARAMS = [
    ("enc.weight", (6, 4), 0),
    ("enc.bias", (6,), 1),
    ("head.weight", (3, 6), 0),
    ("frozen", (4, 2), 1),
]
GROUPS = [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.005, "betas": (0.8, 0.9)}]
STEPS = 2


def global_value(seed: int, shape) -> torch.Tensor:
    """A deterministic full tensor (its own generator: never the shared global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def groups_of(params: dict[str, torch.Tensor]) -> list[dict]:
    return [
        {"params": [params[n] for n, _, gi in PARAMS if gi == i], **GROUPS[i]}
        for i in range(len(GROUPS))
    ]


def grads_at(t: int) -> dict[str, torch.Tensor | None]:
    return {
        n: None if n == "frozen" else global_value(100 * t + i, shape)
        for i, (n, shape, _) in enumerate(PARAMS)
    }


def train() -> tuple[dict, dict]:
    """The reference: the same training on full plain tensors, in one process.
    Returns ({fqn: {key: tensor}}, {fqn: hyperparameters of its group})."""
    full = {n: global_value(i, shape) for i, (n, shape, _) in enumerate(PARAMS)}
    opt = torch.optim.Adam(groups_of(full))
    for t in range(STEPS):
        for n, g in grads_at(t).items():
            full[n].grad = g
        opt.step()
    state = {
        n: {k: v.clone() for k, v in opt.state[full[n]].items()}
        for n, _, _ in PARAMS
        if full[n] in opt.state
    }
    hyper = {}
    for n, _, gi in PARAMS:
        hyper[n] = {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
    return state, hyper


def sharded_model():
    """(records, optimizer) on this rank: DTensor params, Adam over them, nothing stepped."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp_optim._infra.params import ParamRecord

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = {
        n: torch.nn.Parameter(distribute_tensor(global_value(i, shape), mesh, [Shard(0)]))
        for i, (n, shape, _) in enumerate(PARAMS)
    }
    records = [ParamRecord(n, params[n], params[n]) for n, _, _ in PARAMS]
    return records, torch.optim.Adam(groups_of(params))


def train_sharded(records, opt) -> None:
    from torch.distributed.tensor import distribute_tensor

    for t in range(STEPS):
        for r in records:
            g = grads_at(t)[r.fqn]
            r.param.grad = (
                None if g is None else distribute_tensor(g, r.param.device_mesh, r.param.placements)
            )
        opt.step()


def _write(rank: int, world: int, init: str, out: str, written_by: str) -> None:
    import torch.distributed as dist

    from mfsdp_optim.checkpoint import build_sharded_state_dict, save_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    records, opt = sharded_model()
    train_sharded(records, opt)
    sd = build_sharded_state_dict(opt, records)
    save_checkpoint({"optimizer": sd}, out, metadata={"written_by": written_by})
    dist.destroy_process_group()


def generate(target: str, written_by: str) -> None:
    """Write the fixture into ``target`` with the code on ``sys.path``, on 2 spawned ranks."""
    import tempfile

    import torch.multiprocessing as mp

    init = os.path.join(tempfile.mkdtemp(), "init")
    args = (2, init, os.path.abspath(target), written_by)
    mp.start_processes(_write, args=args, nprocs=2, start_method="spawn")


if __name__ == "__main__":
    generate(sys.argv[1], "mfsdp_optim 0.1.0")
