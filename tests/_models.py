"""The small FSDP2 model the wrapper tests share (optim/ and checkpoint/ test modules).

``_model`` builds an uneven MLP from an explicit seed, ``_batch`` a deterministic input per step,
``_shard`` applies ``fully_shard`` per Linear and then to the root; ``llama_hsdp_metas`` the
whole-param planner's view of the Llama-like 1B set under HSDP (``benchmarks/bench_muon.py``
measures and plans that same set from here); ``ELEMENTWISE_KWARGS`` the
elementwise ``torch.optim`` classes and the options the tests step them with.
"""

from __future__ import annotations

import torch

ELEMENTWISE_KWARGS = {
    "SGD": dict(lr=0.1, momentum=0.9),
    "Adam": dict(lr=0.01),
    "AdamW": dict(lr=0.01, weight_decay=0.1),
    "Adagrad": dict(lr=0.1),
    "Adadelta": dict(lr=1.0),
    "Adamax": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "RMSprop": dict(lr=0.01),
    "Rprop": dict(lr=0.01),
    "ASGD": dict(lr=0.01),
}


def _model(seed: int, sizes=(6, 5, 3, 1)) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(len(sizes) - 1):
        lin = torch.nn.Linear(sizes[i], sizes[i + 1])
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.5)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 0.5)
        layers += [lin, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(step: int, seed: int = 100, in_dim: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randn(8, in_dim, generator=gen)


def _shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


LLAMA_MATRICES = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048)]
LLAMA_MATRICES += [(5632, 2048), (5632, 2048), (2048, 5632)]


def llama_hsdp_metas(world, replicas, layers=16, *, dtype="torch.bfloat16", norms=False):
    """The planner's metas of ``layers`` layers of the Llama-like 1B set (its matrices, and
    with ``norms`` its two 2048-long norm weights) under HSDP: ``replicas`` replica groups
    (Replicate on mesh dim 0) of ``world // replicas`` shards (Shard(0) on dim 1)."""
    from mfsdp_optim.optim.seam import ParamMeta

    shapes = LLAMA_MATRICES + ([(2048,), (2048,)] if norms else [])
    return [
        ParamMeta(
            f"layers.{i}.{j}",
            tuple(range(world)),
            (replicas, world // replicas),
            (("R",), ("S", 0)),
            shape,
            dtype,
        )
        for i in range(layers)
        for j, shape in enumerate(shapes)
    ]
