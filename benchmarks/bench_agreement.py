#!/usr/bin/env python
"""Per-step cost of the stats path's rank agreement, on real gloo ranks, old and new in one run.

``--world`` CPU ranks (gloo, FileStore rendezvous), ``--grads`` fp32 DTensor grads of
``--rows x 64`` on a 1-D mesh with ``Shard(0)``. Timed, interleaved round by round, median of
``--repeats`` calls after ``--warmup``, max over ranks:

* ``old``: the previous protocol: the rank's contribution plus a failed-ranks slot, ONE
  ``all_reduce(SUM)`` of 4 float64 (p < inf), the norm finished on the device, no agreement;
* ``new``: :func:`mfsdp_optim.stats.seam.reduce_grads`: ONE ``all_gather`` of a 7-float64 row
  (contribution, failure flag, norm_type, count_zeros, magic), 4 numbers per rank read on the
  host, arguments compared, rows combined in rank order;
* ``grad_stats``: the whole public call (bucketing + local norms + ``new``), for scale.

With ``--backend nccl`` (one GPU per rank) each is timed to the end of a ``synchronize`` and, as
``<name> host``, to the return of the call (the CPU time; ``new`` reads 4 numbers per rank back,
so it returns only once the collective is done).

Usage: ``python benchmarks/bench_agreement.py [--world 4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _old_reduce(buckets, norm_type, count_zeros, group):
    """The protocol before the agreement (commit bf91e21), reproduced for p < inf."""
    from mfsdp_optim.stats.kernels import contribution, finish_norm

    local = contribution(buckets, norm_type=norm_type, count_zeros=count_zeros, group=group)
    local = torch.nn.functional.pad(local, (0, 1))
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    failed = local[3] > 0
    return torch.where(failed, torch.nan, finish_norm(local[0], norm_type)), local[2] > 0


def _worker(rank, world, init, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    cuda = args.backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import grad_stats
    from mfsdp_optim.stats.kernels import bucket_local_shards
    from mfsdp_optim.stats.seam import reduce_grads

    dev = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(dev, (world,))
    gen = torch.Generator().manual_seed(rank)
    grads = [
        DTensor.from_local(
            torch.randn(args.rows, 64, generator=gen).to(dev), mesh, (Shard(0),), run_check=False
        )
        for _ in range(args.grads)
    ]
    buckets = bucket_local_shards(grads, None)
    fns = {
        "old": lambda: _old_reduce(buckets, 2.0, False, None),
        "new": lambda: reduce_grads(buckets, norm_type=2.0, count_zeros=False, group=None),
        "grad_stats": lambda: grad_stats(grads),
    }
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = [*fns, *(f"{k} host" for k in fns)] if cuda else list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(args.warmup + args.repeats):
        for name in names:  # interleaved: drift hits every variant alike
            fn = fns[name.split()[0]]
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            if not name.endswith("host"):  # on CUDA: "host" is the CPU time before the sync
                sync()
            dt = (time.perf_counter() - t0) * 1e6
            sync()
            if i >= args.warmup:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, med)
    if rank == 0:
        out.put({k: max(g[k] for g in gathered) for k in med})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--grads", type=int, default=100)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(), "init")
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, init, args, out))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join()
    print(
        f"world {args.world}, {args.grads} grads of {args.rows}x64 fp32 per rank "
        "(median us per call, max over ranks)"
    )
    for k, v in res.items():
        print(f"  {k:16s} {v:9.1f} us")
    print(f"  new/old    {res['new'] / res['old']:.2f}x  (+{res['new'] - res['old']:.1f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "us": res}, f, indent=1)


if __name__ == "__main__":
    main()
