"""Checkpoint layer benchmark: 10,000 params on 4 CPU gloo ranks.

Measures, per rank (max over ranks reported):
  * build_sharded_state_dict: time and collectives (top-level torch.distributed calls);
  * build(is_loading=True) + load_sharded_state_dict: time and collectives;
  * DCP save and DCP load of this package's state dict vs stock torch's
    get_optimizer_state_dict + dcp.save / dcp.load + set_optimizer_state_dict, on the same
    tensors (the stock optimizer's state is bound to the very same storage).

Run: python benchmarks/bench_checkpoint.py [--params 10000] [--world 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_NAMES = ["all_gather_object", "all_gather", "all_reduce", "broadcast", "broadcast_object_list",
          "gather_object", "scatter_object_list", "reduce_scatter", "barrier", "all_to_all"]


class Count:
    def __enter__(self):
        self.n, self.saved = 0, {}
        for name in _NAMES:
            fn = self.saved[name] = getattr(dist, name)

            def w(*a, __fn=fn, **k):
                self.n += 1
                return __fn(*a, **k)
            setattr(dist, name, w)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def timed(fn, counter=None):
    """Wall time of fn between barriers; collectives fn issues are counted in counter."""
    dist.barrier()
    t = time.perf_counter()
    if counter is None:
        out = fn()
    else:
        with counter:
            out = fn()
    dist.barrier()
    return out, time.perf_counter() - t


def worker(rank, world, n_params, shape, tmp, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim._params import ParamRecord
    from mfsdp_optim.checkpoint import build_sharded_state_dict, load_sharded_state_dict

    mesh = init_device_mesh("cpu", (world,))
    gshape = (shape[0] * world, shape[1])
    model = torch.nn.Module()
    records = []
    for i in range(n_params):
        local = torch.randn(shape)
        p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                  shape=gshape, stride=(shape[1], 1)))
        model.register_parameter(f"p{i}", p)
        records.append(ParamRecord(f"p{i}", p, p._local_tensor))
    # the base optimizer over local aliases, as FullyShardedOptimizer feeds it; one step
    opt = torch.optim.Adam([r.opt_param for r in records], lr=1e-3)
    for r in records:
        r.opt_param.grad = torch.randn(shape)
    opt.step()
    # stock: an optimizer over the DTensor params whose state is the same storage
    stock = torch.optim.Adam(model.parameters(), lr=1e-3)
    for r in records:
        st = opt.state[r.opt_param]
        stock.state[r.param] = {
            "step": st["step"],
            **{k: DTensor.from_local(st[k], mesh, [Shard(0)], run_check=False, shape=gshape,
                                     stride=(shape[1], 1)) for k in ("exp_avg", "exp_avg_sq")}}
    res = {}
    c = Count()
    sd, res["build_s"] = timed(lambda: build_sharded_state_dict(opt, records), c)
    res["build_collectives"] = c.n
    _, res["ours_save_s"] = timed(lambda: dcp.save({"optimizer": sd}, checkpoint_id=f"{tmp}/ours"))
    osd, res["stock_get_s"] = timed(lambda: get_optimizer_state_dict(model, stock))
    _, res["stock_dcp_save_s"] = timed(
        lambda: dcp.save({"optimizer": osd}, checkpoint_id=f"{tmp}/stock"))
    res["stock_save_s"] = res["stock_get_s"] + res["stock_dcp_save_s"]
    res["ours_save_total_s"] = res["build_s"] + res["ours_save_s"]

    target, res["ours_target_s"] = timed(
        lambda: build_sharded_state_dict(opt, records, is_loading=True))
    _, res["ours_dcp_load_s"] = timed(
        lambda: dcp.load({"optimizer": target}, checkpoint_id=f"{tmp}/ours"))
    c = Count()
    _, res["load_s"] = timed(lambda: load_sharded_state_dict(opt, records, target), c)
    res["load_collectives"] = c.n
    res["ours_load_total_s"] = res["ours_target_s"] + res["ours_dcp_load_s"] + res["load_s"]

    def stock_load():
        o = get_optimizer_state_dict(model, stock)
        dcp.load({"optimizer": o}, checkpoint_id=f"{tmp}/stock")
        set_optimizer_state_dict(model, stock, o)
    _, res["stock_load_total_s"] = timed(stock_load)
    queue.put((rank, res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=10_000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4, help="local rows per param per rank")
    ap.add_argument("--cols", type=int, default=16)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    procs = [ctx.Process(target=worker, args=(r, args.world, args.params, (args.rows, args.cols),
                                              tmp, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(tmp, ignore_errors=True)
    keys = results[0].keys()
    worst = {k: max(results[r][k] for r in results) for k in keys}
    state_mb = args.params * args.rows * args.cols * args.world * 4 * 2 / 2**20
    print(f"{args.params} params, {args.world} gloo CPU ranks, Adam state {state_mb:.1f} MiB "
          f"global (exp_avg + exp_avg_sq), worst rank shown; wall {time.perf_counter() - t0:.0f}s")
    print(f"build_sharded_state_dict : {worst['build_s'] * 1e3:8.1f} ms, "
          f"{worst['build_collectives']} collective(s)")
    print(f"load_sharded_state_dict  : {worst['load_s'] * 1e3:8.1f} ms, "
          f"{worst['load_collectives']} collective(s)")
    print(f"build(is_loading=True)   : {worst['ours_target_s'] * 1e3:8.1f} ms")
    rows = [("save (state dict + dcp.save)", worst["ours_save_total_s"], worst["stock_save_s"]),
            ("load (target + dcp.load + load)", worst["ours_load_total_s"],
             worst["stock_load_total_s"])]
    print(f"{'':34}{'ours':>10}{'stock':>10}{'ours/stock':>12}")
    for name, ours, stock in rows:
        print(f"{name:34}{ours:9.2f}s{stock:9.2f}s{ours / stock:11.2f}x")
    tot_o = rows[0][1] + rows[1][1]
    tot_s = rows[0][2] + rows[1][2]
    print(f"{'save + load':34}{tot_o:9.2f}s{tot_s:9.2f}s{tot_o / tot_s:11.2f}x")
    print(f"  (ours dcp.save alone {worst['ours_save_s']:.2f}s vs stock dcp.save alone "
          f"{worst['stock_dcp_save_s']:.2f}s; ours dcp.load alone {worst['ours_dcp_load_s']:.2f}s)")


if __name__ == "__main__":
    sys.exit(main())
