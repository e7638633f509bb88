"""Stock ``torch.optim.Muon`` on full local tensors vs the wrapper's whole-param step on shards.

Every rank steps the full matrices of a Llama-like layer with stock Muon (the anchor: what one
GPU does without sharding) and, on the same values, ``FullyShardedOptimizer(Muon(...))`` over
the same matrices sharded ``Shard(0)`` over all ranks (Newton-Schulz input to one owner per
matrix, the result back: ``optim/_whole``). Calls alternate in rounds; the median ms per step
and the ratio are printed, and the params must come out bit for bit equal. A CPU row always;
``--device cuda`` adds one (NCCL for CUDA tensors, gloo for CPU ones).

    PYTHONPATH=src python benchmarks/bench_muon.py [--device cuda] [--layers 2] [--steps 5]
    PYTHONPATH=src torchrun --nproc-per-node 8 benchmarks/bench_muon.py --device cuda \\
        --layers 16 --scale 1 --cpu-scale 8       # several GPUs (one process each)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mfsdp_optim import FullyShardedOptimizer

SHAPES = [
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (5632, 2048),
    (5632, 2048),
    (2048, 5632),
]


def _timed(device: str, fn) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def bench(device: str, layers: int, steps: int, scale: int) -> tuple[float, float]:
    """(stock ms, wrapper ms) per step, medians of alternating calls."""
    shapes = [(m // scale, n // scale) for m, n in SHAPES] * layers
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    sharded = [torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values]
    for p, q, g in zip(plain, sharded, grads, strict=True):
        p.grad = g.clone()
        q.grad = distribute_tensor(g, mesh, [Shard(0)])
    stock = torch.optim.Muon(plain, lr=0.02)
    wrapper = FullyShardedOptimizer(torch.optim.Muon(sharded, lr=0.02))
    stock.step()  # warm-up (and the wrapper's plan: one object all-gather)
    wrapper.step()
    t_stock, t_wrap = [], []
    for i in range(steps):
        pair = [(t_stock, stock.step), (t_wrap, wrapper.step)]
        for times, fn in pair if i % 2 == 0 else pair[::-1]:
            times.append(_timed(device, fn))
    for p, q in zip(plain, sharded, strict=True):
        assert torch.equal(p.detach(), q.full_tensor().detach()), "whole-param step differs"
    return statistics.median(t_stock), statistics.median(t_wrap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="divide every matrix dim (CUDA row)")
    ap.add_argument("--cpu-scale", type=int, default=4, help="the same for the CPU row")
    args = ap.parse_args()
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        init = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        print(f"{world} rank(s)")
        print(f"{'device':24} {'stock ms':>10} {'wrapper ms':>11} {'ratio':>7}")
    for device in ["cpu"] + (["cuda"] if args.device == "cuda" else []):
        scale = args.cpu_scale if device == "cpu" else args.scale
        stock_ms, wrap_ms = bench(device, args.layers, args.steps, scale)
        if rank == 0:
            name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            print(f"{name:24} {stock_ms:10.2f} {wrap_ms:11.2f} {wrap_ms / stock_ms:7.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
