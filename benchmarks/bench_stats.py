#!/usr/bin/env python
"""Benchmark of the stats layer against stock torch, on the same DTensor grads, in one run.

One process, world size 1 (nccl on CUDA, gloo on CPU, FileStore rendezvous), fp32 DTensor grads
on a 1-D mesh with ``Shard(0)``. Two shape sets: 300 x (4096 x 1024) and 3000 x (512 x 256).
Timed per set, each the median of ``--repeats`` calls after ``--warmup`` calls (CUDA events
around each call on CUDA, ``perf_counter`` on CPU):

* ``floor``: grad bytes / device-to-device copy bandwidth (bytes read + written per second,
  measured in the same run with one large copy), i.e. the time to read every grad once;
* ``grad_stats`` (this package), without and with ``count_zeros``, and with the fused kernel
  switched off (the pure-torch multi-tensor fallback);
* ``torch.nn.utils.get_total_norm`` over the grads + ``full_tensor()`` of the result;
* ``torch.nn.utils.clip_grad_norm_`` (max_norm huge, so the grads keep their values);
* anchors: ``torch.linalg.vector_norm`` over one flat buffer of the same bytes and
  ``torch._foreach_norm`` over the local tensors;
* on CUDA, diagnostics of the fused path: the kernel alone (launch plan built once), the fused
  bucket call (host + kernel), the table cache on/off, and host-side (CPU wall) costs of the
  bucketing loop in ``stats/_buckets.py``, of the fused call and of the whole ``grad_stats`` call.

Usage: ``python benchmarks/bench_stats.py [--json out.json]``; on a CPU-only machine add
``--scale 0.01`` (shrinks tensor counts and rows) for a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import mfsdp_optim  # noqa: E402
from mfsdp_optim.stats import kernels  # noqa: E402

SETS = [("300x4096x1024", 300, (4096, 1024)), ("3000x512x256", 3000, (512, 256))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of one call (CUDA events around each call on CUDA)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        pairs = []
        for _ in range(repeats):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pairs.append((a, b))
        torch.cuda.synchronize(device)
        return statistics.median(a.elapsed_time(b) for a, b in pairs)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def host_ms(
    fn: Callable[[], object], device: torch.device, calls: int = 10, rounds: int = 7
) -> float:
    """CPU wall milliseconds per call, the device left to run behind (no sync inside)."""
    fn()
    res = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res.append((time.perf_counter() - t0) * 1e3 / calls)
    _sync(device)
    return statistics.median(res)


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, repeats: int) -> float:
    """Bytes per second moved by a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * nbytes / (ms * 1e-3)


def init_world(device: torch.device) -> None:
    if dist.is_initialized():
        return
    path = os.path.join(tempfile.mkdtemp(prefix="bench_stats_"), "store")
    store = dist.FileStore(path, 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def run_set(name, count, shape, device, mesh, bw, args) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    locals_ = [torch.randn(shape, device=device, generator=gen) for _ in range(count)]
    grads = [DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for t in locals_]
    params = []
    for g in grads:
        prm = torch.nn.Parameter(
            DTensor.from_local(torch.empty_like(g._local_tensor), mesh, [Shard(0)], run_check=False)
        )
        prm.grad = g
        params.append(prm)
    nbytes = sum(t.numel() * t.element_size() for t in locals_)
    floor = nbytes / bw * 1e3
    W, R = args.warmup, args.repeats
    rows: dict[str, float] = {"floor": floor}

    def timed(label, fn, warmup=W, repeats=R):
        rows[label] = time_ms(fn, device, warmup, repeats)

    def get_total_norm():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        return n.full_tensor() if isinstance(n, DTensor) else n

    def fallback_stats():
        os.environ["MFSDP_OPTIM_DISABLE_FUSED"] = "1"
        try:
            return mfsdp_optim.grad_stats(grads)
        finally:
            del os.environ["MFSDP_OPTIM_DISABLE_FUSED"]

    timed("grad_stats", lambda: mfsdp_optim.grad_stats(grads))
    timed("grad_stats count_zeros", lambda: mfsdp_optim.grad_stats(grads, count_zeros=True))
    timed("grad_stats fused off", fallback_stats)
    slow_r = max(5, R // 4)
    timed("get_total_norm+full_tensor", get_total_norm, warmup=2, repeats=slow_r)
    timed(
        "clip_grad_norm_",
        lambda: torch.nn.utils.clip_grad_norm_(params, max_norm=1e30),
        warmup=2,
        repeats=slow_r,
    )
    flat = torch.randn(sum(t.numel() for t in locals_), device=device, generator=gen)
    timed("anchor: vector_norm(flat)", lambda: torch.linalg.vector_norm(flat))
    timed(
        "anchor: _foreach_norm",
        lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(locals_))),
    )

    # correctness of what was timed: the package against a float64 reference
    st = mfsdp_optim.grad_stats(grads, count_zeros=True)
    ref = math.sqrt(sum(t.double().pow(2).sum().item() for t in locals_))
    check = {
        "grad_stats_norm": st.total_norm.item(),
        "reference_norm": ref,
        "rel_err": abs(st.total_norm.item() - ref) / ref,
        "num_zeros": int(st.num_zeros.item()),
        "found_inf": bool(st.found_inf.item()),
    }

    diag: dict[str, float] = {}
    if device.type == "cuda" and kernels.fused_available(device):
        kw = dict(norm_type=2.0, replication=1, canonical=True, count_zeros=False)
        plan = kernels.launch_plan(locals_, 2.0, 1, True, False)
        kernel = kernels.load_kernel()
        timed("fused kernel only", lambda: kernels.launch(kernel, plan))
        timed("fused bucket call", lambda: kernels.shard_contribution(locals_, **kw))
        kernels.set_table_cache(False)
        try:
            timed(
                "fused bucket call, no table cache",
                lambda: kernels.shard_contribution(locals_, **kw),
            )
            timed("grad_stats, no table cache", lambda: mfsdp_optim.grad_stats(grads))
            diag["host: fused bucket call, no table cache"] = host_ms(
                lambda: kernels.shard_contribution(locals_, **kw), device
            )
        finally:
            kernels.set_table_cache(True)
        diag["host: fused kernel launch only"] = host_ms(
            lambda: kernels.launch(kernel, plan), device
        )
        diag["host: fused bucket call"] = host_ms(
            lambda: kernels.shard_contribution(locals_, **kw), device
        )
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                kernels.shard_contribution(locals_, **kw)
                kernels.bucket_local_shards(grads, None)
            prof.disable()
            _sync(device)
            print(
                f"\n# host profile, {name}: 20 x (fused bucket call + _buckets.bucket_local_shards)"
            )
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        diag["fused programs"] = plan.num_progs
        learned = kernels.programs_per_sm(plan.kernel_key)
        diag["fused programs per SM"] = -1 if learned is None else learned
    diag["host: _buckets.bucket_local_shards"] = host_ms(
        lambda: kernels.bucket_local_shards(grads, None), device
    )
    diag["host: grad_stats"] = host_ms(lambda: mfsdp_optim.grad_stats(grads), device)

    return {
        "set": name,
        "count": count,
        "shape": list(shape),
        "bytes": nbytes,
        "ms": rows,
        "x_floor": {k: v / floor for k, v in rows.items()},
        "host_ms": diag,
        "check": check,
    }


def sweep(device: torch.device, warmup: int, repeats: int) -> None:
    """Tune the fused kernel: time the kernel alone (plan built once) for a few
    (BLOCK, num_warps, FOLD) choices and grid sizes, on both shape sets."""
    kernel = kernels.load_kernel()
    saved = kernels.tuning()
    configs = [(2048, 4, 4), (1024, 4, 4), (2048, 8, 4), (4096, 8, 4), (4096, 4, 8), (8192, 8, 8)]
    for name, count, shape in SETS:
        gen = torch.Generator(device=device).manual_seed(0)
        ts = [torch.randn(shape, device=device, generator=gen) for _ in range(count)]
        nbytes = sum(t.numel() * 4 for t in ts)
        print(f"\n# sweep {name}: kernel only, ms and GB/s")
        for cfg in configs:
            kernels.set_tuning(kernels.Tuning(*cfg))
            try:
                plan = kernels.launch_plan(ts, 2.0, 1, True, False)
                kernels.launch(kernel, plan)  # compiles, learns the occupancy
                learned = kernels.programs_per_sm(plan.kernel_key)
                for pps in sorted({learned, 1, 2, 4, 8, 16} - {0}):
                    kernels.set_programs_per_sm(plan.kernel_key, pps)
                    plan = kernels.launch_plan(ts, 2.0, 1, True, False)
                    ms = time_ms(
                        lambda plan=plan: kernels.launch(kernel, plan), device, warmup, repeats
                    )
                    tag = " (learned)" if pps == learned else ""
                    print(
                        f"BLOCK={cfg[0]:5d} warps={cfg[1]} FOLD={cfg[2]} "
                        f"programs/SM={pps:2d}{tag:10s} {ms:8.3f} ms {nbytes / ms / 1e6:8.0f} GB/s"
                    )
                kernels.set_programs_per_sm(plan.kernel_key, learned)
            except Exception as exc:  # keep sweeping
                print(f"{cfg}: failed: {exc!r}")
        for zeros, p in [(True, 2.0), (False, math.inf), (False, 1.0), (False, 1.5), (False, 0.5)]:
            kernels.set_tuning(saved)
            plan = kernels.launch_plan(ts, p, 1, True, zeros)
            kernels.launch(kernel, plan)
            plan = kernels.launch_plan(ts, p, 1, True, zeros)
            ms = time_ms(lambda plan=plan: kernels.launch(kernel, plan), device, warmup, repeats)
            print(
                f"default cfg, p={p} count_zeros={zeros}: {ms:8.3f} ms "
                f"{nbytes / ms / 1e6:8.0f} GB/s"
            )
        del ts
    kernels.set_tuning(saved)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--scale", type=float, default=None, help="shrink tensor counts and rows")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sets", default="all", help="all, or a comma list of set names")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--sweep", action="store_true", help="tune the fused kernel first (CUDA)")
    ap.add_argument("--profile", action="store_true", help="print a host profile of the fused call")
    args = ap.parse_args()

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 0.01)
    init_world(device)
    mesh = init_device_mesh(device.type, (1,))
    if args.sweep and device.type == "cuda" and kernels.fused_available(device):
        sweep(device, args.warmup, args.repeats)

    copy_bytes = 2 * 2**30 if device.type == "cuda" else max(2**20, int(2**28 * scale))
    bw = copy_bandwidth(device, copy_bytes, args.warmup, max(10, args.repeats))

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "fused_available": kernels.fused_available(device) if device.type == "cuda" else False,
        "scale": scale,
        "copy_bandwidth_GBps": bw / 1e9,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    results = []
    for name, count, (rows_, cols) in SETS:
        if args.sets != "all" and name not in args.sets.split(","):
            continue
        c = max(1, round(count * scale))
        r = max(1, round(rows_ * scale))
        results.append(run_set(name, c, (r, cols), device, mesh, bw, args))

    print(f"# stats-layer benchmark  {env}")
    for res in results:
        print(f"\n## {res['count']} x {tuple(res['shape'])} fp32 ({res['bytes'] / 1e9:.3f} GB)")
        print(f"{'what':44s} {'ms':>10s} {'x floor':>9s}")
        for k, v in res["ms"].items():
            print(f"{k:44s} {v:10.3f} {res['x_floor'][k]:9.2f}")
        for k, v in res["host_ms"].items():
            if isinstance(v, float):
                print(f"{k:44s} {v:10.3f} {'(CPU)':>9s}")
            else:
                print(f"{k:44s} {v!s:>10s}")
        print(f"check: {res['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
