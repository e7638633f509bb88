"""Checkpoint layer benchmark, side by side with stock torch in one run, on gloo CPU ranks.

One Adam over DTensor params (``Shard(0)`` on a 1-D mesh of the world; the wrapper's transparent
case: the base optimizer holds the DTensors, its state is DTensors), stepped once. Then, in this
order, on the same optimizer and the same tensors:

  * stock: ``get_optimizer_state_dict`` + ``dcp.save``; ``get_optimizer_state_dict`` +
    ``dcp.load`` + ``set_optimizer_state_dict``;
  * ours, plain DCP: ``build_sharded_state_dict`` + ``dcp.save``; ``build(is_loading=True)`` +
    ``dcp.load`` + ``load_sharded_state_dict``;
  * ours, ``save_checkpoint`` / ``load_checkpoint`` (checksums on, verified on load);
  * ours, ``save_checkpoint(asynchronous=True)``: the time the call blocks the caller (with and
    without the state dict's build), and the time until ``wait()`` returns.

Reported: the worst rank's wall time of each phase (between barriers), bytes on disk, the items in
``.metadata``, the bytes each rank handed to the keyspace agreement (``collective_bytes_sent``), and
peak RSS of rank 0 and of the last rank during each phase (sampled every 2 ms from /proc, as the
increase over the RSS before the phase), against the size of the rank's state.

Run::

    python benchmarks/bench_checkpoint.py                          # 1,200 params of 48x48, 2 ranks
    python benchmarks/bench_checkpoint.py --params 10000 --world 4 --rows 4 --cols 16
    python benchmarks/bench_checkpoint.py --keyspace-only --world 8  # agreement bytes only
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """The largest RSS increase over the value at entry, sampled every 2 ms by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.delta = self.peak - self.base


def phase(res: dict, name: str, fn):
    """Run fn between barriers; record wall time and peak RSS increase under ``name`` (the
    smallest over repeats: on a shared box the others' jobs only ever add time)."""
    dist.barrier()
    with PeakRSS() as mem:
        t = time.perf_counter()
        out = fn()
        dist.barrier()
        took = time.perf_counter() - t
    res[f"{name}_s"] = min(took, res.get(f"{name}_s", took))
    res[f"{name}_rss"] = max(mem.delta, res.get(f"{name}_rss", 0))
    return out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _items(path: str) -> int:
    from mfsdp_optim.checkpoint import safe_read_metadata

    return len(safe_read_metadata(path).state_dict_metadata)


def _model(n_params: int, shape, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.checkpoint import ParamRecord

    mesh = init_device_mesh("cpu", (world,))
    gshape = (shape[0] * world, shape[1])
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(n_params):
        local = torch.randn(shape, generator=g)
        p = torch.nn.Parameter(
            DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=gshape, stride=(shape[1], 1)
            )
        )
        model.register_parameter(f"p{i}", p)
    records = [ParamRecord(n, p, p) for n, p in model.named_parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt, records


def worker(rank, world, args, tmp, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from mfsdp_optim.checkpoint import (
        build_sharded_state_dict,
        load_checkpoint,
        load_sharded_state_dict,
        save_checkpoint,
    )
    from mfsdp_optim.checkpoint.seam import collective_bytes_sent, describe_state

    model, opt, records = _model(args.params, (args.rows, args.cols), world)
    res: dict = {
        "state_bytes": sum(
            v._local_tensor.numel() * v._local_tensor.element_size()
            for s in opt.state.values()
            for v in s.values()
            if v.dim() > 0
        )
    }
    sent0 = collective_bytes_sent()
    build_sharded_state_dict(opt, records)
    res["keyspace_sent"] = collective_bytes_sent() - sent0
    # what the detailed exchange (0.1.0's only path, now the fallback) would send per rank
    import pickle

    res["detail_sent"] = 8 + len(
        pickle.dumps(describe_state(opt, records).description, protocol=pickle.HIGHEST_PROTOCOL)
    )
    if args.keyspace_only:
        queue.put((rank, res))
        dist.destroy_process_group()
        return

    def stock_save():
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=f"{tmp}/stock")

    def stock_load():
        osd = get_optimizer_state_dict(model, opt)
        dcp.load({"optimizer": osd}, checkpoint_id=f"{tmp}/stock")
        set_optimizer_state_dict(model, opt, osd)

    def ours_save():
        dcp.save({"optimizer": build_sharded_state_dict(opt, records)}, checkpoint_id=f"{tmp}/ours")

    def ours_load():
        target = build_sharded_state_dict(opt, records, is_loading=True)
        dcp.load({"optimizer": target}, checkpoint_id=f"{tmp}/ours")
        load_sharded_state_dict(opt, records, target)

    def safe_save():
        sd = {"optimizer": build_sharded_state_dict(opt, records)}
        save_checkpoint(sd, f"{tmp}/safe{rep[0]}")

    def async_save():
        t = time.perf_counter()
        sd = {"optimizer": build_sharded_state_dict(opt, records)}
        t_built = time.perf_counter()
        handle = save_checkpoint(sd, f"{tmp}/async{rep[0]}", asynchronous=True)
        t_back = time.perf_counter()
        block, call = t_back - t, t_back - t_built
        res["async_block_s"] = min(block, res.get("async_block_s", block))  # what training waits
        res["async_call_s"] = min(call, res.get("async_call_s", call))  # save_checkpoint alone
        handle.wait()

    def safe_load():
        target = build_sharded_state_dict(opt, records, is_loading=True)
        load_checkpoint({"optimizer": target}, f"{tmp}/safe{rep[0]}")
        load_sharded_state_dict(opt, records, target)

    rep = [0]
    phases = [
        ("stock_save", stock_save),
        ("stock_load", stock_load),
        ("ours_save", ours_save),
        ("ours_load", ours_load),
        ("safe_save", safe_save),
        ("safe_load", safe_load),
        ("async_save", async_save),
    ]
    for rep[0], (name, fn) in ((r, p) for r in range(args.repeat) for p in phases):
        if os.environ.get("BENCH_PROFILE") == name and rank == 0:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            phase(res, name, fn)
            prof.disable()
            restrict = (
                [os.environ["BENCH_PROFILE_FILTER"]] if "BENCH_PROFILE_FILTER" in os.environ else []
            )
            pstats.Stats(prof).sort_stats("cumulative").print_stats(*restrict, 25)
        else:
            phase(res, name, fn)
    if rank == 0:
        last = args.repeat - 1
        for kind, name in (("stock", "stock"), ("ours", "ours"), ("safe", f"safe{last}")):
            res[f"{kind}_bytes"] = _dir_bytes(f"{tmp}/{name}")
            res[f"{kind}_items"] = _items(f"{tmp}/{name}")
        res["async_bytes"] = _dir_bytes(f"{tmp}/async{last}")
    dist.barrier()
    queue.put((rank, res))
    dist.destroy_process_group()


def run(args) -> dict[int, dict]:
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.world, args, tmp, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1200)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", type=int, default=24, help="local rows per param per rank")
    ap.add_argument("--cols", type=int, default=48)
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of every phase; the fastest is reported"
    )
    ap.add_argument(
        "--keyspace-only",
        action="store_true",
        help="only the bytes each rank sends to agree on the keyspace",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    res = run(args)
    print(
        f"load average (1 min) at the start {load0:.1f}, at the end {os.getloadavg()[0]:.1f}, "
        f"on {os.cpu_count()} CPUs"
    )
    sent = sorted({r["keyspace_sent"] for r in res.values()})
    print(
        f"{args.params} params of {args.rows * args.world}x{args.cols}, {args.world} gloo CPU "
        f"ranks, best of {args.repeat}; keyspace agreement: {sent} bytes sent per rank (the "
        "detailed exchange: "
        f"{max(r['detail_sent'] for r in res.values())} bytes sent, x{args.world} received)"
    )
    if args.keyspace_only:
        return
    worst = {k: max(r[k] for r in res.values()) for k in res[0] if k.endswith("_s")}
    r0 = res[0]
    print(
        f"wall {time.perf_counter() - t0:.0f}s; state per rank {r0['state_bytes'] / 2**20:.2f} "
        f"MiB; worst rank's time"
    )
    print(
        f"{'':22}{'save s':>9}{'load s':>9}{'total s':>9}{'x stock':>9}{'MiB':>9}"
        f"{'x stock':>9}{'items':>8}{'x plain':>9}"
    )
    stock_t = worst["stock_save_s"] + worst["stock_load_s"]
    plain_t = worst["ours_save_s"] + worst["ours_load_s"]
    for kind, label in (
        ("stock", "stock torch"),
        ("ours", "ours, plain dcp"),
        ("safe", "ours, save_checkpoint"),
    ):
        t = worst[f"{kind}_save_s"] + worst[f"{kind}_load_s"]
        b = r0[f"{kind}_bytes"]
        print(
            f"{label:22}{worst[f'{kind}_save_s']:9.2f}{worst[f'{kind}_load_s']:9.2f}{t:9.2f}"
            f"{t / stock_t:9.2f}{b / 2**20:9.2f}{b / r0['stock_bytes']:9.2f}"
            f"{r0[f'{kind}_items']:8d}{t / plain_t:9.2f}"
        )
    print(
        "x plain: against ours with plain dcp.save/dcp.load (save_checkpoint/load_checkpoint "
        f"with checksums on: save {worst['safe_save_s'] / worst['ours_save_s']:.2f}x, load "
        f"{worst['safe_load_s'] / worst['ours_load_s']:.2f}x)"
    )
    block = max(r["async_block_s"] for r in res.values())
    call = max(r["async_call_s"] for r in res.values())
    safe_t = worst["safe_save_s"] + worst["safe_load_s"]
    print(
        f"asynchronous save_checkpoint: blocks {block:.3f} s with the state dict's build "
        f"({call:.3f} s the call alone), {block / worst['safe_save_s']:.3f}x the synchronous "
        f"save's {worst['safe_save_s']:.2f} s; published after {worst['async_save_s']:.2f} s; "
        f"{r0['async_bytes'] / 2**20:.2f} MiB on disk"
    )
    print(
        f"targets: save_checkpoint+load_checkpoint {safe_t / stock_t:.2f}x stock (<= 0.6); "
        f"bytes {r0['safe_bytes'] / r0['stock_bytes']:.2f}x stock (<= 1.0); async blocking "
        f"{block / worst['safe_save_s']:.3f}x the synchronous save (<= 0.10)"
    )
    print(
        "peak RSS increase over the phase's start, MiB (rank 0 / rank "
        f"{args.world - 1}), state per rank {r0['state_bytes'] / 2**20:.2f} MiB:"
    )
    last = res[args.world - 1]
    for kind in ("stock", "ours", "safe"):
        print(
            f"  {kind:6} save {r0[f'{kind}_save_rss'] / 2**20:7.1f} / "
            f"{last[f'{kind}_save_rss'] / 2**20:7.1f}   load "
            f"{r0[f'{kind}_load_rss'] / 2**20:7.1f} / {last[f'{kind}_load_rss'] / 2**20:7.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
