"""Stock torch.optim.Muon on full local tensors vs the whole-param step (optim/_whole) at world
size 1, same tensors: ms per step and the ratio. A CPU row always; ``--device cuda`` adds one.

    PYTHONPATH=src python benchmarks/bench_muon.py [--device cuda] [--layers 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from mfsdp_optim.optim._whole import step_whole_params

SHAPES = [
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (5632, 2048),
    (5632, 2048),
    (2048, 5632),
]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(device: str, layers: int, steps: int, scale: int) -> tuple[float, float]:
    shapes = [(m // scale, n // scale) for m, n in SHAPES] * layers
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    plain = [torch.nn.Parameter(v.clone().to(device)) for v in values]
    mesh = init_device_mesh(device, (1,))
    sharded = [
        torch.nn.Parameter(DTensor.from_local(v.clone().to(device), mesh, [Shard(0)]))
        for v in values
    ]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.to(device)
    for p, g in zip(sharded, grads, strict=True):
        p.grad = DTensor.from_local(g.to(device), mesh, [Shard(0)])
    stock, whole = torch.optim.Muon(plain, lr=0.02), torch.optim.Muon(sharded, lr=0.02)
    plan = step_whole_params(whole, sharded)  # builds the plan (warm-up)
    stock.step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        stock.step()
    _sync(device)
    t1 = time.perf_counter()
    for _ in range(steps):
        plan = step_whole_params(whole, sharded, plan_cache=plan)
    _sync(device)
    t2 = time.perf_counter()
    for p, q in zip(plain, sharded, strict=True):
        assert torch.equal(p.detach(), q.to_local().detach()), "whole-param step differs"
    return (t1 - t0) / steps * 1e3, (t2 - t1) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scale", type=int, default=4, help="divide every matrix dim by this (CPU)")
    args = ap.parse_args()
    init = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    devices = ["cpu"] + (["cuda"] if args.device == "cuda" else [])
    print(f"{'device':8} {'stock ms':>10} {'whole ms':>10} {'ratio':>7}")
    for device in devices:
        scale = args.scale if device == "cpu" else 1
        stock_ms, whole_ms = bench(device, args.layers, args.steps, scale)
        print(f"{device:8} {stock_ms:10.2f} {whole_ms:10.2f} {whole_ms / stock_ms:7.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
