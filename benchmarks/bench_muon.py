"""Stock ``torch.optim.Muon`` on full local tensors vs the wrapper's whole-param step on shards.

Every rank steps the full matrices of a Llama-like layer with stock Muon (the anchor: what one
GPU does without sharding) and, on the same values, ``FullyShardedOptimizer(Muon(...))`` over
the same matrices sharded ``Shard(0)`` over all ranks (Newton-Schulz input to one owner per
matrix, the result back: ``optim/_whole``). Calls alternate in rounds; the median ms per step
and the ratio are printed, and the params must come out bit for bit equal. A CPU row always;
``--device cuda`` adds one (NCCL for CUDA tensors, gloo for CPU ones).

    PYTHONPATH=src python benchmarks/bench_muon.py [--device cuda] [--layers 2] [--steps 5]
    PYTHONPATH=src python benchmarks/bench_muon.py --device cuda --layers 16 --scale 1 \\
        --cpu-scale 8 [--batched on|off]         # the 1B set (16 layers) on one GPU
    PYTHONPATH=src torchrun --nproc-per-node 8 benchmarks/bench_muon.py --device cuda \\
        --layers 16 --scale 1 --cpu-scale 8       # several GPUs (one process each)
    PYTHONPATH=src python benchmarks/bench_muon.py --plan   # the plan table, no run
    PYTHONPATH=src python benchmarks/bench_muon.py --compare mfsdp_prev=/tmp/prev \\
        [--ns-steps 0] [--census]   # before/after in one run (the old package, renamed)

``--plan`` prints, from the planner alone (exact, like the traffic test), each rank's
Newton-Schulz flops and exchange bytes for the 16-layer set on 8, 64 and 512 ranks with 1, 2
and 4 replicas (HSDP: ``(Replicate(), Shard(0))`` on a ``(replicas, world / replicas)`` mesh),
owners spanning the replicas (now) against one owner per replica group (before); then the same
for Adafactor on the generic path (float32: the busiest rank's whole-param cost and the most
piece bytes any rank moves, the plan's default against one owner per replica group).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _compare import import_other
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import mfsdp_optim

# the Llama-like 1B set: one definition, which the plan tests check the targets on
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _models import LLAMA_MATRICES as SHAPES  # noqa: E402
from _models import llama_hsdp_metas  # noqa: E402


def _timed(device: str, fn) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """Flops of torch's Newton-Schulz on one matrix: per iteration ``X X^T`` (2 r r c), the
    Gram polynomial (2 r^3) and its product with ``X`` (2 r r c), ``r <= c`` after the
    transpose torch does for tall matrices."""
    r, c = sorted(shape)
    return steps * (4 * r * r * c + 2 * r * r * r)


def plan_table(layers: int = 16) -> list[dict]:
    """Per (world, replicas): the busiest rank's Newton-Schulz flops against total / world, and
    the largest bytes any rank sends or receives against twice its local shard bytes, owners
    spanning the replicas (``now``) and one owner per replica group (``before``)."""
    from mfsdp_optim.optim.seam import muon_splits, plan_units

    rows = []
    for world in (8, 64, 512):
        for replicas in (1, 2, 4):
            metas = llama_hsdp_metas(world, replicas, layers)
            once = sum(ns_flops(m.shape) for m in metas)  # the work, done once
            row: dict = {"world": world, "replicas": replicas, "total_gflop": once / 1e9}
            for name, span in (("before", False), ("now", True)):
                units = plan_units([metas] * world, "muon", span_replicas=span)
                flops = [0] * world
                for u in units:
                    flops[u.owner] += ns_flops(u.meta.shape)
                worst_bytes = 0.0
                for rank in range(world):
                    local = 2 * sum(  # bf16 pieces: every param's piece, member or receiver
                        _numel(u.piece_for(rank))
                        for u in units
                        if rank in u.members or rank in u.receivers
                    )
                    s_in, r_in, s_out, r_out = muon_splits(units, rank, world)
                    sent, received = sum(s_in) + sum(s_out), sum(r_in) + sum(r_out)
                    if local:
                        worst_bytes = max(worst_bytes, sent / (2 * local), received / (2 * local))
                row[name] = {
                    "busiest_gflop": max(flops) / 1e9,
                    "busiest_over_even": max(flops) / (once / world),
                    "done_gflop": sum(flops) / 1e9,
                    "bytes_over_2x_local": worst_bytes,
                }
            rows.append(row)
    return rows


def _numel(piece) -> int:
    from mfsdp_optim.optim.seam import piece_numel

    return piece_numel(piece)


def _adafactor_bytes(meta) -> tuple[int, int, int]:
    """torch's Adafactor on float32 params, per element of a piece: param and grad in; the param
    back, with the variance for a 1-D param (param-shaped); a 2-D param's row and column
    factors whole, with the 0-d step (whole bytes per holder)."""
    if len(meta.shape) == 1:
        return 8 + 4, 4 + 4, 4
    return 8, 4, 4 * sum(meta.shape) + 4


def generic_plan_table(layers: int = 16) -> list[dict]:
    """The generic whole-param path (torch's Adafactor, float32) from the plan, per (world,
    replicas), over the same matrices plus two 2048-element vectors per layer: the busiest
    rank's whole-param cost (elements stepped) against total / world, and the most piece bytes
    any rank sends or receives (status words and headers not counted), the plan's default
    (``now``: one owner over all replica groups where no rank holds over half of a param)
    against one owner per replica group (``before``)."""
    import math

    from mfsdp_optim.optim.seam import generic_traffic, plan_units

    rows = []
    for world in (8, 64, 512):
        for replicas in (1, 2, 4):
            metas = llama_hsdp_metas(world, replicas, layers, dtype="torch.float32", norms=True)
            total = sum(math.prod(m.shape) for m in metas)
            row: dict = {"world": world, "replicas": replicas}
            for name, span in (("before", False), ("now", None)):
                units = plan_units([metas] * world, "generic", span_replicas=span)
                load = [0] * world
                for u in units:
                    load[u.owner] += u.cost
                traffic = generic_traffic(units, world, _adafactor_bytes)
                row[name] = {
                    "busiest_over_even": max(load) / (total / world),
                    "most_mb": max(max(t) for t in traffic) / 1e6,
                }
            rows.append(row)
    return rows


def print_generic_plan_table(layers: int) -> None:
    print(f"\nAdafactor (the generic path) over the {layers}-layer set, from the plan (float32)")
    print(
        f"{'ranks':>6} {'repl':>5} | {'busiest/even':>12} {'most MB':>9} | "
        f"{'before: busiest/even':>20} {'most MB':>9} | {'MB now/before':>13}"
    )
    for row in generic_plan_table(layers):
        now, before = row["now"], row["before"]
        print(
            f"{row['world']:6d} {row['replicas']:5d} | {now['busiest_over_even']:12.2f} "
            f"{now['most_mb']:9.1f} | {before['busiest_over_even']:20.2f} "
            f"{before['most_mb']:9.1f} | {now['most_mb'] / before['most_mb']:13.2f}"
        )


def print_plan_table(layers: int) -> None:
    print(f"Newton-Schulz over the {layers}-layer set, from the plan (bf16 exchange)")
    print(
        f"{'ranks':>6} {'repl':>5} | {'busiest GFLOP':>13} {'/even':>6} {'bytes/2xlocal':>13} | "
        f"{'before: busiest':>15} {'/even':>6} {'bytes/2xlocal':>13}"
    )
    for row in plan_table(layers):
        now, before = row["now"], row["before"]
        print(
            f"{row['world']:6d} {row['replicas']:5d} | {now['busiest_gflop']:13.1f} "
            f"{now['busiest_over_even']:6.2f} {now['bytes_over_2x_local']:13.2f} | "
            f"{before['busiest_gflop']:15.1f} {before['busiest_over_even']:6.2f} "
            f"{before['bytes_over_2x_local']:13.2f}"
        )


def bench(
    device: str,
    layers: int,
    steps: int,
    scale: int,
    batched: bool | None = None,
    ns_steps: int = 5,
    other=None,
) -> tuple[float, float, float, float | None]:
    """(stock ms, wrapper ms, params' max abs difference after the run, ``other``'s wrapper ms)
    per step, medians of calls alternating in rounds. The difference is 0 unless ``batched`` is
    True (a device may differ); ``other`` (another copy of the package, ``--compare``) steps its own
    copy of the params, which must come out bit for bit as the wrapper's."""
    shapes = [(m // scale, n // scale) for m, n in SHAPES] * layers
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    stock = torch.optim.Muon(plain, lr=0.02, ns_steps=ns_steps)
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.clone()

    def wrapped(package):
        sharded = [torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values]
        for q, g in zip(sharded, grads, strict=True):
            q.grad = distribute_tensor(g, mesh, [Shard(0)])
        # None (auto) is this version's default; an older copy (--compare) may take bools only
        kw = {} if batched is None else {"batched_newton_schulz": batched}
        config = package.OptimizerConfig(**kw)
        chunk = torch.nn.ParameterList(sharded)  # names the same-shape matrices (model_chunks)
        base = torch.optim.Muon(sharded, lr=0.02, ns_steps=ns_steps)
        return sharded, package.FullyShardedOptimizer(base, config, model_chunks=[chunk])

    sharded, wrapper = wrapped(mfsdp_optim)
    contenders = [(stock.step, []), (wrapper.step, [])]
    if other is not None:
        sharded_other, wrapper_other = wrapped(other)
        contenders.append((wrapper_other.step, []))
    for fn, _ in contenders:  # warm-up (and the wrappers' plans: one object all-gather)
        fn()
    for i in range(steps):
        order = contenders if i % 2 == 0 else contenders[::-1]
        for fn, times in order:
            times.append(_timed(device, fn))
    diff = 0.0
    for p, q in zip(plain, sharded, strict=True):
        full = q.full_tensor().detach()
        diff = max(diff, float((p.detach().double() - full.double()).abs().max()))
    if batched is not True:  # forced batches may round differently: reported, not asserted
        assert diff == 0.0, f"whole-param step differs by {diff}"
    other_ms = None
    if other is not None:
        for q, r in zip(sharded, sharded_other, strict=True):
            assert torch.equal(q.full_tensor(), r.full_tensor()), "--compare: params differ"
        other_ms = statistics.median(contenders[2][1])
    t_stock, t_wrap = (statistics.median(times) for _, times in contenders[:2])
    return t_stock, t_wrap, diff, other_ms


CENSUS_OPS = ("copy_", "lerp", "lerp_", "add_", "mul_", "div_", "linalg_vector_norm", "cat")


def census(layers: int, scale: int, other=None) -> dict[str, dict[str, tuple[int, float]]]:
    """One step of each contender on CPU (one rank) under torch's profiler: per elementwise op,
    its calls and the elements of its first operand over the set's elements (how many passes
    over the set it makes). Exact and independent of the box's load, unlike the timings."""
    import math

    from torch.profiler import ProfilerActivity, profile

    shapes = [(m // scale, n // scale) for m, n in SHAPES] * layers
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    mesh = init_device_mesh("cpu", (1,))
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.clone()
    steps = {"stock": torch.optim.Muon(plain, lr=0.02, ns_steps=0).step}
    for name, package in (("wrapper", mfsdp_optim), ("other", other)):
        if package is None:
            continue
        sharded = [torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values]
        for q, g in zip(sharded, grads, strict=True):
            q.grad = distribute_tensor(g, mesh, [Shard(0)])
        base = torch.optim.Muon(sharded, lr=0.02, ns_steps=0)
        chunk = torch.nn.ParameterList(sharded)
        steps[name] = package.FullyShardedOptimizer(base, model_chunks=[chunk]).step
    total = sum(m * n for m, n in shapes)
    out = {}
    for name, fn in steps.items():
        fn()  # warm-up (the wrappers' plans)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
        calls: dict[str, int] = {}
        elements: dict[str, int] = {}
        for e in prof.events():
            op = e.name.removeprefix("aten::")
            if op in CENSUS_OPS:
                calls[op] = calls.get(op, 0) + 1
                shape = e.input_shapes[0] if e.input_shapes else []
                elements[op] = elements.get(op, 0) + (math.prod(shape) if shape else 0)
        out[name] = {op: (calls[op], elements[op] / total) for op in sorted(calls)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1, help="divide every matrix dim (CUDA row)")
    ap.add_argument("--cpu-scale", type=int, default=4, help="the same for the CPU row")
    ap.add_argument("--plan", action="store_true", help="print the plan table and exit")
    ap.add_argument(
        "--batched",
        choices=["auto", "on", "off"],
        default="auto",
        help="batched_newton_schulz: None (auto, the default), True (on) or False (off)",
    )
    ap.add_argument(
        "--ns-steps",
        type=int,
        default=5,
        help="Muon's ns_steps (torch's default 5); 0 leaves out the GEMMs, the rest of the "
        "step stays (its overhead seen without them)",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="also time the wrapper of another importable copy of the package (e.g. the "
        "previous commit, renamed): 'module' or 'module=PATH'; its column is 'other ms'",
    )
    ap.add_argument(
        "--census",
        action="store_true",
        help="print one step's elementwise ops (calls, passes over the set) of stock, the "
        "wrapper (and --compare's) on CPU, one rank, ns_steps=0, and exit",
    )
    args = ap.parse_args()
    other = import_other(args.compare) if args.compare else None
    if args.plan:
        print_plan_table(16)
        print_generic_plan_table(16)
        return
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        init = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group(backend, init_method=f"file://{init}", rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.census:
        found = census(args.layers, args.cpu_scale, other)
        print(
            f"one step, {args.layers} layer(s) / {args.cpu_scale}: op calls (passes over the set)"
        )
        for op in sorted({op for ops in found.values() for op in ops}):
            row = "  ".join(
                f"{name} {ops[op][0]:3d} ({ops[op][1]:.2f})" if op in ops else f"{name}   -"
                for name, ops in found.items()
            )
            print(f"{op:20} {row}")
        dist.destroy_process_group()
        return
    if rank == 0:
        print(
            f"{world} rank(s), {args.layers} layer(s), batched_newton_schulz={args.batched}, "
            f"ns_steps={args.ns_steps}" + (f", other: {args.compare}" if other else "")
        )
        extra = f" {'other ms':>9} {'ratio':>7}" if other else ""
        print(
            f"{'device':24} {'stock ms':>10} {'wrapper ms':>11} {'ratio':>7} {'max diff':>9}"
            + extra
        )
    batched = {"auto": None, "on": True, "off": False}[args.batched]
    for device in ["cpu"] + (["cuda"] if args.device == "cuda" else []):
        scale = args.cpu_scale if device == "cpu" else args.scale
        stock_ms, wrap_ms, diff, other_ms = bench(
            device, args.layers, args.steps, scale, batched, args.ns_steps, other
        )
        if rank == 0:
            name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            ratio = wrap_ms / stock_ms
            line = f"{name:24} {stock_ms:10.2f} {wrap_ms:11.2f} {ratio:7.3f} {diff:9.2e}"
            if other_ms is not None:
                line += f" {other_ms:9.2f} {other_ms / stock_ms:7.3f}"
            print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
