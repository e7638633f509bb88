"""Scale: N params over mixed dense / expert meshes on W CPU gloo ranks.

Dense params live on the whole world (FSDP, Shard(0)); expert params on the expert-data-parallel
stripe of a (ep, edp) = (2, W/2) mesh, different experts per stripe. Each rank runs
FullyShardedOptimizer(AdamW) steps (stats collective included), then a checkpoint round trip
through save_checkpoint / load_checkpoint into a fresh optimizer, checked bit for bit, and
records peak RSS (ru_maxrss) after each phase against the size of its optimizer state.

Run: python benchmarks/bench_scale.py [--params 10000] [--world 8] [--numel 256]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from datetime import timedelta


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _worker(rank, world, init_file, root, n_params, numel, out_file):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.checkpoint import load_checkpoint, save_checkpoint
    from mfsdp_optim.optim import FullyShardedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    rss = {"start": _rss_mb()}
    dense_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    moe = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "edp"))
    ep = moe.get_coordinate()[0]
    edp_mesh = moe["edp"]
    n_expert = n_params * 2 // 5  # 40% expert params, split over the 2 stripes
    n_dense = n_params - n_expert
    rows = 16

    def make(mesh, seed):
        g = torch.Generator().manual_seed(seed)
        full = torch.randn(rows, numel // rows, generator=g)
        k = mesh.size()
        c = mesh.get_coordinate()[0]
        chunks = torch.chunk(full, k, dim=0)
        local = chunks[c].clone() if c < len(chunks) else full[0:0].clone()
        return torch.nn.Parameter(
            DTensor.from_local(
                local, mesh, (Shard(0),), run_check=False, shape=full.shape, stride=full.stride()
            )
        )

    def build(seed0):
        model = torch.nn.Module()
        dense = torch.nn.Module()
        experts = torch.nn.Module()
        for i in range(n_dense):
            dense.register_parameter(f"w{i}", make(dense_mesh, seed0 + i))
        for i in range(n_expert // 2):
            experts.register_parameter(f"e{ep}_{i}", make(edp_mesh, seed0 + 10**6 + ep * 10**5 + i))
        model.dense, model.experts = dense, experts
        opt = FullyShardedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), model_chunks=[model]
        )
        return model, opt

    model, opt = build(0)
    params = list(model.parameters())
    rss["built"] = _rss_mb()
    t = {}
    t0 = time.perf_counter()
    for step in range(2):
        for i, p in enumerate(params):
            p.grad = DTensor.from_local(
                torch.full_like(p._local_tensor, 1e-3 * (i % 7 + step)),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        opt.step()
        opt.zero_grad()
    t["2 steps (stats + AdamW)"] = time.perf_counter() - t0
    rss["stepped"] = _rss_mb()
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    param_bytes = sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in params)

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        r = fn()
        dist.barrier()
        t[name] = time.perf_counter() - t0
        return r

    sd = timed("sharded_state_dict", lambda: opt.sharded_state_dict())
    timed(
        "dcp.save (plain)",
        lambda: dcp.save({"optimizer": sd}, checkpoint_id=os.path.join(root, "plain")),
    )
    timed(
        "save_checkpoint, no checksums",
        lambda: save_checkpoint({"optimizer": sd}, os.path.join(root, "nocrc")),
    )
    timed(
        "save_checkpoint, checksums",
        lambda: save_checkpoint({"optimizer": sd}, os.path.join(root, "crc")),
    )
    rss["saved"] = _rss_mb()
    sd = None  # drop the state dict (the lambdas above read it late, so no `del`)

    model2, opt2 = build(0)
    target = timed(
        "sharded_state_dict(is_loading)", lambda: opt2.sharded_state_dict(is_loading=True)
    )
    timed(
        "dcp.load (plain)",
        lambda: dcp.load({"optimizer": target}, checkpoint_id=os.path.join(root, "plain")),
    )
    timed(
        "load_checkpoint, no checksum verify",
        lambda: load_checkpoint(
            {"optimizer": target}, os.path.join(root, "nocrc"), verify_checksums=False
        ),
    )
    timed(
        "load_checkpoint, checksum verify",
        lambda: load_checkpoint({"optimizer": target}, os.path.join(root, "crc")),
    )
    timed("load_state_dict", lambda: opt2.load_state_dict(target))
    rss["loaded"] = _rss_mb()
    same = all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
        for (pa, a), (pb, b) in zip(
            opt.optimizer.state.items(), opt2.optimizer.state.items(), strict=True
        )
        for k in a
    )
    res = {
        "rank": rank,
        "rss_mb": rss,
        "times_s": t,
        "state_mb": state_bytes / 2**20,
        "param_mb": param_bytes / 2**20,
        "bitwise_equal": same,
        "local_params": len(opt.optimizer.param_groups[0]["params"]),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=10000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--numel", type=int, default=256, help="elements per param (16 rows)")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix="mfsdp_scale_")
    out_file = os.path.join(root, "result.json")
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                args.world,
                os.path.join(root, "init"),
                root,
                args.params,
                args.numel,
                out_file,
            ),
        )
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"a rank failed: {[p.exitcode for p in procs]}")
    with open(out_file) as f:
        res = json.load(f)
    sizes = {
        d: sum(os.path.getsize(os.path.join(root, d, f)) for f in os.listdir(os.path.join(root, d)))
        / 2**20
        for d in ("plain", "crc")
    }
    print(
        f"{args.params} params x {args.numel} elements, {args.world} ranks, wall "
        f"{time.perf_counter() - t0:.1f}s; checkpoint {sizes['plain']:.1f} MiB "
        f"(with checksums {sizes['crc']:.1f} MiB)"
    )
    print("rank  params  state MiB  param MiB  peak RSS MiB: built / stepped / saved / loaded")
    for r in res:
        rss = r["rss_mb"]
        print(
            f"{r['rank']:>4}  {r['local_params']:>6}  {r['state_mb']:>9.1f}  "
            f"{r['param_mb']:>9.1f}  {rss['built']:.0f} / {rss['stepped']:.0f} / "
            f"{rss['saved']:.0f} / {rss['loaded']:.0f}   bitwise {r['bitwise_equal']}"
        )
    print("phase (max over ranks, s):")
    for k in res[0]["times_s"]:
        print(f"  {k:<40} {max(r['times_s'][k] for r in res):.2f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
