"""Per-step cost of FullyShardedOptimizer vs the bare base optimizer and stock torch on DTensors.

One rank (a world-size-1 gloo or NCCL group on a FileStore), fp32, AdamW fused and foreach, two
shape sets: 3000 x (512 x 256) and 300 x (4096 x 1024). For each it times

  (a) bare:    the base optimizer's step on plain local tensors (the target),
  (b) stock:   the same torch optimizer stepping the DTensor params (what FSDP2 users get),
  (c) wrap:    FullyShardedOptimizer.step() on the DTensor params: grad_stats (one collective),
               clip (--clip, default 1.0: clipping acts), the base step and the return values,
               On CUDA in fused mode the default steps through the package's Triton kernel
               (OptimizerConfig(triton_adam_step=True): its launch table is kept between
               steps, the note counts launches and builds),
  (d) wrap-torch: the same with OptimizerConfig(triton_adam_step=False), torch's fused kernel
               (fused mode, CUDA only: elsewhere it is the default),
  (e) grad_stats (``--grad-stats``): ``mfsdp_optim.stats.grad_stats`` alone on the same kind of
               grads, against its own floor (every grad read once: 4 bytes per element),
  (f) captured: OptimizerConfig(host_sync=False, cuda_graph=True): the step captured in a CUDA
               graph once and replayed (fused mode, CUDA only; the grads stay in place),

and the floor: 28 bytes/param (AdamW reads p, g, m, v and writes p, m, v in fp32) over the
measured device copy bandwidth. All contenders are built first (``--one-at-a-time``, the default
with ``--model``: each is built beside bare, timed with it and freed, so a large model fits one
card; its ratios are then against the bare time of its own rounds) and timed in rounds, one call of
each per round with the order rotating, so a slow spell of the host hits them alike (the host
of the device machine varies up to 2x between minutes); the median per contender is reported.
GPU timings use CUDA events; CPU timings use perf_counter.

    python benchmarks/bench_step.py                       # auto device, full sizes
    python benchmarks/bench_step.py --device cpu --scale 0.01 --iters 5
    python benchmarks/bench_step.py --clip 0 --profile    # clipping off; host profile
    python benchmarks/bench_step.py --count-scale 0.1     # fewer params per set
    python benchmarks/bench_step.py --optimizer apex_fused_adam  # apex FusedAdam as the base
    python benchmarks/bench_step.py --sets 3000x512x256 --modes fused --grad-stats --check-cost
    python benchmarks/bench_step.py --model llama1b --modes fused --back-to-back 4  # host ahead
    python benchmarks/bench_step.py --host-time           # host time of one step() call only

Against another commit (``--compare``: its package copied and renamed; ``--compare-first``
builds it first; the wrapper built first in a run times a few percent slower, so run both orders
and take the geometric mean of the ratios):

    mkdir -p /tmp/p /tmp/prev && git archive <commit> src/mfsdp_optim | tar -x -C /tmp/p
    mv /tmp/p/src/mfsdp_optim /tmp/prev/mfsdp_prev
    python benchmarks/bench_step.py --sets 3000x512x256 --modes fused,foreach \
        --compare mfsdp_prev=/tmp/prev [--compare-first]
    python benchmarks/bench_step.py --model llama1b --modes fused \
        --compare mfsdp_prev=/tmp/prev [--compare-first]

``--host-time`` measures, instead of the sets, the host time of one ``step()`` call (perf_counter
around the call, no synchronisation inside it; the device drained before each call) of fused
AdamW over 300, 3,000 and 30,000 tensors of 16x16 (``--host-counts``), where the device work is
negligible: the wrapper (host_sync=True), nosync (host_sync=False) and, on CUDA, captured. The
target of the captured step is 0.1 ms at every count (flat in the tensor count).

``--optimizer apex_fused_adam`` (apex importable, CUDA) times apex's FusedAdam (adam_w_mode) in
place of AdamW: one mode, ``apex``, and no ``stock`` cell (its kernels take plain tensors only).

``--scale`` shrinks each param's rows (keeps the param count, so host overhead stays visible);
``--count-scale`` shrinks the number of params.

``--model llama1b`` times, in place of ``--sets``, the params of a Llama 1.2B-like model (one
local tensor per param, as the sets): embedding 32000x2048; 16 blocks of q/k/v/o 2048x2048,
gate/up 5632x2048, down 2048x5632 and two 2048 norms; final norm 2048; lm head 32000x2048
(147 params, 953 M elements). ``--scale`` shrinks the rows of its 2-D params (the 1-D norms keep
their 2048), ``--count-scale`` the number of blocks. With a model, or with ``--bare-clip``, a
contender **bare+clip** joins: the bare base optimizer on the same kind of plain local tensors
plus ``torch.nn.utils.clip_grad_norm_(locals, --clip)`` (the stock baseline with clipping; not
with ``--clip 0``), and a second line gives every contender over bare+clip:

    python benchmarks/bench_step.py --model llama1b --modes fused
    python benchmarks/bench_step.py --device cpu --model llama1b --scale 0.002 --iters 3
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _compare import import_other
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

_TORCH_KERNEL = {"triton_adam_step": False}  # torch's fused kernel: bit-identical to stock
SHAPE_SETS = {"3000x512x256": (3000, (512, 256)), "300x4096x1024": (300, (4096, 1024))}


def _llama1b(scale: float, count_scale: float) -> list[tuple[int, ...]]:
    """Param shapes of a Llama 1.2B-like model (torch's (out, in) Linear layout), the 2-D
    params' rows times ``scale``, ``round(16 * count_scale)`` blocks (at least 1)."""
    d, ff, vocab = 2048, 5632, 32000

    def rows(r: int) -> int:
        return max(1, round(r * scale))

    block = [(rows(d), d)] * 4 + [(rows(ff), d)] * 2 + [(rows(d), ff), (d,), (d,)]
    blocks = max(1, round(16 * count_scale))
    return [(rows(vocab), d)] + block * blocks + [(d,), (rows(vocab), d)]


MODELS = {"llama1b": _llama1b}


def _shape_set(name: str) -> tuple[int, tuple[int, int]]:
    """``(count, (rows, cols))`` of a named set or of any ``COUNTxROWSxCOLS`` (e.g.
    ``3000x1x8``: tiny tensors, a host-bound proxy where device work is negligible)."""
    if name in SHAPE_SETS:
        return SHAPE_SETS[name]
    try:
        count, rows, cols = (int(x) for x in name.split("x"))
    except ValueError:
        msg = f"--sets: {name!r} is neither one of {sorted(SHAPE_SETS)} nor COUNTxROWSxCOLS"
        raise SystemExit(msg) from None
    return count, (rows, cols)


_BACK_TO_BACK = 1  # --back-to-back


def _time_once(device: torch.device, fn) -> float:
    """Milliseconds per call of ``_BACK_TO_BACK`` calls made back to back after one sync (CUDA
    events on GPU). 1: the host work before a call's first kernel is device time too; more:
    the host runs ahead as in training, where a step's host work overlaps the device's
    previous work, and what is left is what the device waits for."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(_BACK_TO_BACK):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / _BACK_TO_BACK
    t0 = time.perf_counter()
    for _ in range(_BACK_TO_BACK):
        fn()
    return (time.perf_counter() - t0) * 1e3 / _BACK_TO_BACK


def _timer(device: torch.device, fn, warmup: int, iters: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    return statistics.median(_time_once(device, fn) for _ in range(iters))


def _interleaved(device: torch.device, fns: dict, warmup: int, iters: int) -> dict:
    """Median milliseconds per call of each fn, timed in rounds (one call of each per round, the
    order rotating), so that a slow spell of the host or the GPU hits every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(iters):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(_time_once(device, fns[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def _factories(
    shapes, device, mesh, kw, base_opt, args, other, triton_row, apex, with_clip, captured_row
):
    """Each contender but bare as a builder: () -> (step fn, wrapper or None, tensors to check).
    The wrapper rows: the default (the Triton update for fused groups on CUDA) and, where that
    differs, torch's kernel (the bit-exact path); then the compared copy's."""
    import mfsdp_optim.optim as this

    def make(seed, dtensors=True):
        return _make_shapes(shapes, device, mesh, seed, dtensors)

    def wrapper(pkg, extra):
        def build():
            ps = make(2)[1]
            w = pkg.FullyShardedOptimizer(
                base_opt(ps, kw), pkg.OptimizerConfig(clip_grad=args.clip, **extra)
            )
            return w.step, w, []

        return build

    def stock():
        dp = make(1)[1]
        return torch.optim.AdamW(dp, **kw).step, None, dp

    def stats():
        from mfsdp_optim.stats import grad_stats

        gs = [q.grad for q in make(4)[1]]
        return (lambda: grad_stats(gs)), None, []

    def clip():
        cl = make(3, dtensors=False)[0]
        return _bare_clip(base_opt(cl, kw), cl, args.clip), None, cl

    out: dict[str, Callable[[], tuple]] = {} if apex else {"stock": stock}
    extras: dict[str, dict] = {"wrap": {} if not args.no_triton else _TORCH_KERNEL}
    if triton_row:
        extras["wrap-torch"] = _TORCH_KERNEL
    compared: dict[str, Callable[[], tuple]] = {}
    for name, extra in list(extras.items()) if other is not None else ():
        if name == "wrap" and triton_row:  # the same kernel as this default, by name
            extra = {"triton_adam_step": True}
        compared[f"{name}[{other.__name__}]"] = wrapper(other, extra)
    if args.compare_first:  # built (and their tensors allocated) before this package's rows
        out.update(compared)
    for name, extra in extras.items():
        out[name] = wrapper(this, extra)
    if captured_row:
        out["captured"] = wrapper(this, {**extras["wrap"], "host_sync": False, "cuda_graph": True})
    if args.grad_stats:
        out["grad_stats"] = stats
    if not args.compare_first:
        out.update(compared)
    if with_clip:
        out["bare+clip"] = clip
    return out


def _note(name, w) -> str:
    tri = _triton_of(w)
    extra = (
        f", {tri.launches} triton launches, {tri.builds} table builds"
        if tri and tri.launches
        else ""
    )
    tools = _seam_of(w)
    captured = tools.captured_step_of(w) if tools is not None else None
    if captured is not None:
        g = captured.graph
        extra += f", {g.captures} capture(s), {g.replays} replays of the last"
        extra += f", eager since: {g.disabled}" if g.disabled else ""
    return f"{name}: {w.fast_steps} fast steps, {w.clip_folds} clip folds{extra}"


def _time_contenders(device, bare, factories, warmup, iters, one_at_a_time, check):
    """Median ms per call of ``bare`` and of each factory's step, each one's bare time, and the
    wrappers' notes; ``check(tensors, holders)`` runs on what each contender left.

    Together (default): every contender built first, all timed in the same rounds. One at a
    time: each contender built beside ``bare``, the two timed in rounds, checked, then freed
    before the next is built, so only two copies of the tensors live at once (a large model on
    one card); each ratio is then against the bare time of its own rounds."""
    t: dict[str, float] = {}
    pair: dict[str, float] = {}
    notes: list[str] = []
    groups = [list(factories)] if not one_at_a_time else [[n] for n in factories]
    bares = []
    for names in groups:
        made = {n: factories[n]() for n in names}
        got = _interleaved(
            device, {"bare": bare, **{n: m[0] for n, m in made.items()}}, warmup, iters
        )
        bares.append(got["bare"])
        for n in names:
            t[n], pair[n] = got[n], got["bare"]
        holders = {n: m[1] for n, m in made.items() if m[1] is not None}
        check([x for m in made.values() for x in m[2]], holders)
        notes += [_note(n, w) for n, w in holders.items()]
        del made, holders
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t["bare"] = pair["bare"] = statistics.median(bares)
    return t, pair, notes


def _copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _timer(device, lambda: dst.copy_(src), 3, 10)
    return 2 * src.numel() * 4 / (ms / 1e3)


def _make(count, shape, device, mesh, seed, dtensors=True):
    return _make_shapes([shape] * count, device, mesh, seed, dtensors)


def _make_shapes(shapes, device, mesh, seed, dtensors=True):
    """Plain local tensors with grads (and, with ``dtensors``, DTensor params wrapping copies of
    them on ``mesh``), one per shape; the same values for the same seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    locals_ = [torch.randn(shape, device=device, generator=gen) for shape in shapes]
    grads = [torch.randn(shape, device=device, generator=gen) * 1e-3 for shape in shapes]
    params = [
        torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False))
        for t in (locals_ if dtensors else [])
    ]
    for p, g in zip(params, grads if dtensors else [], strict=True):
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
    for t, g in zip(locals_, grads, strict=True):
        t.grad = g
    return locals_, params


def _runs_of(shapes):
    """``[(shape, count)]`` over the distinct shapes, in order of first appearance."""
    counts: dict[tuple[int, ...], int] = {}
    for sh in shapes:
        counts[tuple(sh)] = counts.get(tuple(sh), 0) + 1
    return [(sh, k) for sh, k in counts.items()]


def _bare_clip(opt, locals_, clip: float):
    """The stock baseline with clipping: ``clip_grad_norm_`` on the plain tensors, then the
    base optimizer's step."""

    def step():
        torch.nn.utils.clip_grad_norm_(locals_, clip)
        opt.step()

    return step


def _check_finite(label, mode, tensors, wrappers) -> None:
    """A timed run that left NaN/inf in params or grads is not a result (one host read)."""
    tensors = list(tensors)
    for w in wrappers.values():
        tensors += [p for g in w.param_groups for p in g["params"]]
    tensors += [t.grad for t in tensors if t.grad is not None]
    flags = [(t._local_tensor if isinstance(t, DTensor) else t).isfinite().all() for t in tensors]
    if not bool(torch.stack(flags).all()):
        raise SystemExit(f"{label} {mode}: non-finite params or grads after timing")


def _profile(fn, label: str, device: torch.device) -> None:
    """cProfile of 5 calls (host time by function), after the host time per call: the time
    until the call returns, then until the device is idle (a step that ends in a host read
    waits for the device inside the call)."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    host, total = [], []
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    print(
        f"--- {label}: host {statistics.median(host) * 1e3:.2f} ms per call until it returns, "
        f"{statistics.median(total) * 1e3:.2f} ms until the device is idle (median of 10) ---"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        fn()
    prof.disable()
    sync()
    print(f"--- host profile, 5 calls, {label} (tottime) ---")
    pstats.Stats(prof).sort_stats("tottime").print_stats(28)
    print(f"--- host profile, 5 calls, {label} (cumulative, this package) ---")
    pstats.Stats(prof).sort_stats("cumulative").print_stats("mfsdp_optim", 24)


def _check_cost(tensors) -> None:
    """ns per tensor of ``device_table.same_addresses`` (the per-step check of the persistent
    tables: the C++ loop where torch has it) and of the Python comparison."""

    from mfsdp_optim.optim import seam

    ptrs = seam.addresses(tensors)
    idx = list(range(len(tensors)))
    n = 200

    def per_tensor(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n / len(tensors) * 1e9

    bulk = per_tensor(lambda: seam.same_addresses(tensors, ptrs, idx))
    py = per_tensor(lambda: seam.addresses(tensors) == ptrs)
    cpp = "C++" if seam.bulk_check_available() else "Python (no C++ helper)"
    print(f"address check: same_addresses ({cpp}) {bulk:.1f} ns/tensor, Python {py:.1f} ns/tensor")


def _host_times(device: torch.device, mesh, args) -> None:
    """Median host time of one ``step()`` call (``--host-time``; the module docstring)."""
    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = [("wrap", {}), ("nosync", {"host_sync": False})]
    if device.type == "cuda":
        rows.append(("captured", {"host_sync": False, "cuda_graph": True}))
    for count in (int(c) for c in args.host_counts.split(",")):
        ms: dict[str, float] = {}
        notes = []
        for name, extra in rows:
            ps = _make_shapes([(16, 16)] * count, device, mesh, 2)[1]
            w = FullyShardedOptimizer(
                torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
                OptimizerConfig(clip_grad=args.clip, **extra),
            )
            for _ in range(args.warmup + 1):  # the first step creates the state (and captures)
                w.step()
            times = []
            for _ in range(args.iters):
                sync()  # drained before, not inside, the timed call
                t0 = time.perf_counter()
                w.step()
                times.append(time.perf_counter() - t0)
            sync()
            ms[name] = statistics.median(times) * 1e3
            notes.append(_note(name, w))
            del w, ps
        cells = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
        ratios = ""
        if "captured" in ms:
            c = ms["captured"]
            verdict = "within" if c <= 0.1 else "OVER"
            ratios = (
                f" | captured/wrap {c / ms['wrap']:.3f}, captured/nosync "
                f"{c / ms['nosync']:.3f}; captured {verdict} the 0.1 ms target"
            )
        print(
            f"host time of one step(), {count} x 16x16 fused AdamW (median of {args.iters}): "
            f"{cells}{ratios} | {'; '.join(notes)}"
        )


def _seam_of(wrapper):
    """The ``optim.seam`` of the package the wrapper comes from (this one or the ``--compare``
    copy), or None where that copy predates it (its notes are left out then)."""
    package = type(wrapper).__module__.split(".")[0]
    try:
        return importlib.import_module(f"{package}.optim.seam")
    except ImportError:
        return None


def _triton_of(wrapper):
    """The wrapper's Triton step (its first engine's), or None."""
    tools = _seam_of(wrapper)
    return tools.engines_of(wrapper)[0].triton if tools is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=float, default=1.0, help="row multiplier per param")
    ap.add_argument("--count-scale", type=float, default=1.0, help="param count multiplier")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--one-at-a-time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build and time each contender beside bare, then free it (two copies of the "
        "tensors at once; the default with --model, so a large model fits one card)",
    )
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--back-to-back",
        type=int,
        default=1,
        help="calls per timing, made back to back after one sync (default 1: the host work "
        "before a call's first kernel counts as device time; more: the host runs ahead, as in "
        "training)",
    )
    ap.add_argument(
        "--no-triton",
        action="store_true",
        help="the wrapper rows use torch's kernel (triton_adam_step=False), no wrap-torch row",
    )
    ap.add_argument(
        "--sets",
        default=",".join(SHAPE_SETS),
        help="comma-separated shape sets: named ones or COUNTxROWSxCOLS (e.g. 3000x1x8)",
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="time a model's param set instead of --sets (adds bare+clip)",
    )
    ap.add_argument(
        "--bare-clip",
        action="store_true",
        help="also time bare+clip (base step + clip_grad_norm_) with --sets",
    )
    ap.add_argument("--modes", default="fused,foreach")
    ap.add_argument(
        "--grad-stats",
        action="store_true",
        help="also time mfsdp_optim.stats.grad_stats alone on the same kind of grads",
    )
    ap.add_argument(
        "--check-cost",
        action="store_true",
        help="also time the persistent tables' per-step address check per tensor",
    )
    ap.add_argument("--clip", type=float, default=1.0, help="OptimizerConfig.clip_grad (0: off)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile 5 calls of every wrapper (and grad_stats) per row (host time by "
        "function), after its host time per call",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="also time the wrapper of another importable copy of the package (e.g. "
        "the previous main, renamed): 'module' or 'module=PATH' (PATH is put "
        "on sys.path); its rows are 'wrap[module]' (and 'wrap-torch[module]')",
    )
    ap.add_argument(
        "--compare-first",
        action="store_true",
        help="build the --compare rows before this package's (the wrapper built first in a "
        "run tends to time a few percent slower: run both orders and take the geometric "
        "mean of the two ratios)",
    )
    ap.add_argument(
        "--optimizer",
        choices=("adamw", "apex_fused_adam"),
        default="adamw",
        help="the base optimizer (apex_fused_adam: apex.optimizers.FusedAdam)",
    )
    ap.add_argument(
        "--host-time",
        action="store_true",
        help="only the host time of one step() call over many 16x16 tensors (see above)",
    )
    ap.add_argument(
        "--host-counts",
        default="300,3000,30000",
        help="tensor counts of --host-time (comma-separated)",
    )
    args = ap.parse_args()
    if args.one_at_a_time is None:
        args.one_at_a_time = args.model is not None
    global _BACK_TO_BACK
    if args.back_to_back < 1:
        ap.error(f"--back-to-back must be >= 1, got {args.back_to_back}")
    _BACK_TO_BACK = args.back_to_back
    other = import_other(args.compare) if args.compare else None
    apex = args.optimizer == "apex_fused_adam"
    if apex:
        from apex.optimizers import FusedAdam

        args.modes, args.no_triton = "apex", True

    def base_opt(params, kw):
        if apex:
            return FusedAdam(params, lr=kw["lr"], weight_decay=kw["weight_decay"], adam_w_mode=True)
        return torch.optim.AdamW(params, **kw)

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    bw = _copy_bandwidth(device, 256 * 2**20 if device.type == "cuda" else 64 * 2**20)
    print(
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}),"
        f" torch {torch.__version__}, copy bandwidth {bw / 1e9:.1f} GB/s, "
        f"{_BACK_TO_BACK} call(s) back to back per timing"
    )
    if args.host_time:
        _host_times(device, mesh, args)
        dist.destroy_process_group()
        return
    runs = []  # (label, param shapes)
    if args.model:
        shapes = MODELS[args.model](args.scale, args.count_scale)
        n = sum(math.prod(sh) for sh in shapes)
        runs.append((f"{args.model}[{len(shapes)}p,{n / 1e6:.1f}M]", shapes))
    else:
        for set_name in args.sets.split(","):
            count, (rows, cols) = _shape_set(set_name)
            count = max(1, round(count * args.count_scale))
            rows = max(1, round(rows * args.scale))
            runs.append((f"{count}x{rows}x{cols}", [(rows, cols)] * count))
    with_clip = (args.model is not None or args.bare_clip) and args.clip > 0
    if args.model:
        print(
            f"{runs[0][0]}: {len(runs[0][1])} params, "
            f"{sum(math.prod(sh) for sh in runs[0][1])} elements, shapes "
            + ", ".join(f"{k} x {sh}" for sh, k in _runs_of(runs[0][1]))
        )
    for label, shapes in runs:
        numel = sum(math.prod(sh) for sh in shapes)
        floor_ms = 28 * numel / bw * 1e3
        for mode in args.modes.split(","):
            kw = {"lr": 1e-3, "weight_decay": 0.01, **({} if apex else {mode: True})}
            locals_, _ = _make_shapes(shapes, device, mesh, 0, dtensors=False)
            bare_step = base_opt(locals_, kw).step
            triton_row = mode == "fused" and device.type == "cuda" and not args.no_triton
            captured_row = mode == "fused" and device.type == "cuda" and not apex
            factories = _factories(
                shapes,
                device,
                mesh,
                kw,
                base_opt,
                args,
                other,
                triton_row,
                apex,
                with_clip,
                captured_row,
            )
            t, pair_bare, notes = _time_contenders(
                device,
                bare_step,
                factories,
                args.warmup,
                args.iters,
                args.one_at_a_time,
                lambda ts, ws, lb=label, md=mode, lc=locals_: _check_finite(lb, md, lc + ts, ws),
            )
            cells = " ".join(
                f"{k} {t[k]:.2f} ms ({t[k] / pair_bare[k]:.2f}x bare, {t[k] / floor_ms:.2f}x floor)"
                for k in ["bare", *factories]
                if k != "grad_stats"
            )
            if "grad_stats" in t:  # its own floor: every grad read once, 4 bytes per element
                stats_floor = 4 * numel / bw * 1e3
                cells += (
                    f" grad_stats {t['grad_stats']:.3f} ms ({t['grad_stats'] / stats_floor:.2f}x"
                    f" its floor {stats_floor:.3f} ms)"
                )
            print(f"{label} {mode}: floor {floor_ms:.2f} ms | {cells} | {', '.join(notes)}")
            if with_clip:
                c = t["bare+clip"]
                print(
                    f"{label} {mode} over bare+clip ({c:.2f} ms, clip {args.clip:g}): "
                    + ", ".join(
                        f"{k}/bare+clip {t[k] / c:.3f}"
                        for k in ["bare", *factories]
                        if k != "bare+clip"
                    )
                )
            if args.check_cost:
                _check_cost(locals_)
            if args.profile:  # each wrapper (and grad_stats) built again, one at a time
                for k, make in factories.items():
                    if k.startswith("wrap") or k == "grad_stats":
                        _profile(make()[0], f"{label} {mode} {k}", device)
            del locals_, bare_step, factories
            if device.type == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
