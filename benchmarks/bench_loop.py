"""Training-loop throughput: stock clip + AdamW vs FullyShardedOptimizer, host_sync on and off.

A small decoder-only transformer (default 4 layers, d_model 256, 4 heads, seq 128, batch 8,
vocab 1024, biases and LayerNorms: many small params, so an H200 waits on the host), FSDP2
``fully_shard`` per block and at the root on a world-size-1 group (nccl on CUDA, gloo on CPU,
FileStore init), fp32. Each contender gets its own model, built from the same seed, and the same
batches (a pool of 16 cycled, so the loss falls). One iteration = forward, backward, clip to 1.0,
fused AdamW step, zero_grad:

  (a) stock:  ``clip_grad_norm_(model.parameters(), 1.0)`` + ``AdamW(fused=True).step()`` and
              ``norm.item()`` every iteration (what logging the norm costs);
  (b) wrap:   ``FullyShardedOptimizer(AdamW(fused=True), OptimizerConfig(clip_grad=1.0))``
              (``host_sync=True``, the default: step() returns the norm as a float);
  (c) nosync: the same with ``OptimizerConfig(clip_grad=1.0, host_sync=False)``: the returned
              norm tensors go into a list, read (one stack + tolist) after the loop.
  (d) graph:  the same with ``cuda_graph=True`` as well (CUDA only): the step captured once and
              replayed; ``zero_grad(set_to_none=False)``, so FSDP2 accumulates into the same
              grad tensors and the capture holds (docs/concepts.md, "The captured step").

Timing: all contenders are built and warmed up first; then rounds, each running ``--iters``
iterations of every contender back to back (the order rotating between rounds), wall clock
around one contender's whole loop with one synchronize at its end (for (c) the read of its norms
is inside the window). The median over rounds is reported as iterations/s, with c/a, c/b, b/a
(ratios of iterations/s: above 1, the first is faster).

A fourth model, **stock/div**, untimed, trains like (a) except that its clip divides the grads
by ``max(1, (norm + 1e-6) / max_norm)`` instead of multiplying them by ``min(1, max_norm /
(norm + 1e-6))``: the arithmetic the wrapper's clip fold uses inside torch's fused kernel
(``grad_scale``), which rounds differently in the last bit on clipped steps. Adam amplifies such
last-bit differences over hundreds of steps (on the H200 the wrapper's params part from stock's
by 7e-9 after the first clipped step and by 1e-5 ten steps later; with the fold off, ``MFSDP_
OPTIM_DISABLE_CLIP_FOLD=1``, they stay bit-identical), so how far stock/div ends from (a) is the
noise band of that rounding: the checks below compare against (a) with ``--rtol`` widened to
at least 3x stock/div's deviation, and print both. ``--deterministic`` turns the device's own
nondeterminism off (``torch.use_deterministic_algorithms``, the math attention kernel,
``CUBLAS_WORKSPACE_CONFIG``). The warm-up runs the contenders in lock step and prints each one's
norm and largest param deviation from stock after each of its first ten steps.

Self-checks (the run fails rather than time broken training): after the rounds every model has
taken the same steps on the same batches, so the last training losses and a no-grad loss on a
fixed batch must agree across contenders (``--rtol``), that loss must have fallen from its start
and by the same amount as stock's (``--rtol`` of the fall), and every norm (a, b, c) must be
finite and agree per iteration with stock's (``--rtol``).

    python benchmarks/bench_loop.py                                   # auto device, defaults
    python benchmarks/bench_loop.py --device cpu --iters 3 --layers 1 --dim 32 --rounds 2
    python benchmarks/bench_loop.py --compare mfsdp_optim_main=/path/to/old/src
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _compare import import_other
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, dim)
        self.o = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(args, device, mesh) -> torch.nn.Module:
    """The model from ``args.seed``, sharded with FSDP2 (each block, then the root)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    with torch.no_grad():  # a smaller init than torch's default, so lr 1e-3 trains smoothly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.to(device)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(args, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(16):
        t = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Contender:
    """One model and optimizer; ``run(n)`` does n training iterations from where it stands."""

    clip = 1.0  # the stock contender's max norm (main sets it from --clip)

    def __init__(self, name, model, batches, kind, opt):
        self.name, self.model, self.batches, self.kind, self.opt = name, model, batches, kind, opt
        self.steps = 0
        self.norms: list[float] = []  # every iteration's pre-clip norm, on the host
        self.loss: torch.Tensor | None = None  # the last iteration's training loss

    def run(self, n: int, device: torch.device) -> float:
        """Wall seconds of n iterations, synchronized once at the end."""
        if n <= 0:
            return 0.0
        model, opt, batches = self.model, self.opt, self.batches
        pending: list[torch.Tensor] = []
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[self.steps % len(batches)]
            self.steps += 1
            loss = model(x, y)
            loss.backward()
            if self.kind == "stock/div":  # stock, with its clip rounded as a division
                grads = [p.grad._local_tensor for p in model.parameters()]  # 1 rank: whole
                norm = torch.nn.utils.get_total_norm(grads)
                divisor = ((norm + 1e-6) / self.clip).clamp(min=1.0)
                torch._foreach_div_(grads, divisor)
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.norms.append(norm.item())
            elif self.kind == "stock":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if isinstance(norm, DTensor):
                    norm = norm.full_tensor()
                self.norms.append(norm.item())  # the logging read
            elif self.kind == "sync":
                _, norm, _ = opt.step()
                opt.zero_grad()
                self.norms.append(norm)  # already a float
            else:
                _, norm, _ = opt.step()
                opt.zero_grad(set_to_none=self.kind != "graph")  # graph: the grads stay put
                pending.append(norm)  # a 0-d device tensor, read after the loop
        if pending:
            self.norms += torch.stack(pending).tolist()
        _sync(device)
        self.loss = loss.detach()
        return time.perf_counter() - t0


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value (FSDP2 leaves the root's params unsharded after a forward only)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _lockstep_warmup(n: int, contenders: list[Contender], noise: Contender, device) -> None:
    """The untimed warm-up, one iteration of every contender at a time, printing each one's
    grad norm and its params' largest deviation from stock's after the step (where two runs
    part shows which step did it)."""
    for i in range(n):
        for c in contenders + [noise]:
            c.run(1, device)
        if i >= 10 and i != n - 1:
            continue  # the first ten and the last are enough to see where runs part
        # read after the step: FSDP2 swaps the registered params between forward and backward
        named = [dict(c.model.named_parameters()) for c in contenders + [noise]]
        row = []
        for c, params in zip(contenders + [noise], named, strict=True):
            worst = max(
                (_full(params[k]) - _full(v)).abs().max().item() for k, v in named[0].items()
            )
            row.append(f"{c.name} norm {c.norms[-1]:.6g} dparam {worst:.2e}")
        print(f"warm-up {i + 1}: " + " | ".join(row))


def _eval_loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(*batch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations per contender")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=1.0, help="max grad norm of every contender")
    ap.add_argument(
        "--rtol",
        type=float,
        default=2e-2,
        help="relative tolerance of the cross-contender loss and norm checks",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (slower): no run-to-run noise of the device itself",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="also run (b) and (c) with another importable copy of the package: "
        "'module' or 'module=PATH' (PATH is put on sys.path); rows "
        "'wrap[module]', 'nosync[module]' (the latter only if its "
        "OptimizerConfig takes host_sync)",
    )
    args = ap.parse_args()
    Contender.clip = args.clip
    if args.iters < 1 or args.rounds < 1:
        raise SystemExit("--iters and --rounds must be at least 1")
    if args.dim % args.heads:
        raise SystemExit(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    other = import_other(args.compare) if args.compare else None
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        torch.use_deterministic_algorithms(True)
        if torch.cuda.is_available():
            torch.backends.cuda.enable_flash_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    batches = _batches(args, device)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)

    contenders: list[Contender] = []
    model = _build(args, device, mesh)
    contenders.append(Contender("stock", model, batches, "stock", adamw(model)))
    for name, kind, pkg in (
        ("wrap", "sync", None),
        ("nosync", "nosync", None),
        *((("graph", "graph", None),) if device.type == "cuda" else ()),
        *(
            (
                (f"wrap[{other.__name__}]", "sync", other),
                (f"nosync[{other.__name__}]", "nosync", other),
            )
            if other is not None
            else ()
        ),
    ):
        mod_fso = FullyShardedOptimizer if pkg is None else pkg.FullyShardedOptimizer
        mod_cfg = OptimizerConfig if pkg is None else pkg.OptimizerConfig
        extra: dict = {} if kind == "sync" else {"host_sync": False}
        if kind == "graph":
            extra["cuda_graph"] = True
        try:
            cfg = mod_cfg(clip_grad=args.clip, **extra)
        except TypeError:
            print(f"{name}: skipped ({pkg.__name__}.OptimizerConfig takes no host_sync)")
            continue
        model = _build(args, device, mesh)
        contenders.append(Contender(name, model, batches, kind, mod_fso(adamw(model), cfg)))

    model = _build(args, device, mesh)
    noise = Contender("stock/div", model, batches, "stock/div", adamw(model))  # untimed

    params = list(contenders[0].model.parameters())
    numel = sum(p.numel() for p in params)
    print(
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}),"
        f" torch {torch.__version__}; TinyLM {args.layers} layers, d_model {args.dim}, "
        f"{args.heads} heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}: "
        f"{len(params)} params, {numel} elements; fp32, FSDP2 on 1 rank ({backend}), "
        f"fused AdamW lr {args.lr:g}, clip {args.clip:g}; {args.warmup} warm-up + "
        f"{args.rounds} rounds x {args.iters} iterations"
    )

    start_loss = [_eval_loss(c.model, batches[0]) for c in contenders]
    noise_start = _eval_loss(noise.model, batches[0])
    _lockstep_warmup(args.warmup, contenders, noise, device)
    noise.run(args.rounds * args.iters, device)
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(args.rounds):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for c in order:
            times[c.name].append(c.run(args.iters, device))
        print(
            f"round {r + 1}: "
            + " | ".join(f"{c.name} {args.iters / times[c.name][-1]:.1f} it/s" for c in contenders)
        )

    ips = {k: args.iters / statistics.median(v) for k, v in times.items()}
    a, b, c = ips["stock"], ips["wrap"], ips["nosync"]
    print(
        f"median of {args.rounds} rounds (iterations/s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in ips.items())
        + f" | c/a {c / a:.3f}, c/b {c / b:.3f}, b/a {b / a:.3f}"
        + "".join(
            f", {k}/a {v / a:.3f}" for k, v in ips.items() if k not in ("stock", "wrap", "nosync")
        )
    )
    for ct in contenders:
        captured = _captured_of(ct.opt)
        if captured is not None:
            g = captured.graph
            state = f"eager since: {g.disabled}" if g.disabled else "captured"
            print(f"{ct.name}: {g.captures} capture(s), {g.replays} replays of the last; {state}")
    _check(args, contenders, start_loss, batches, noise, noise_start)
    dist.destroy_process_group()


def _captured_of(opt):
    """The captured step of a wrapper of this package or of the ``--compare`` copy; None for a
    stock optimizer, a wrapper without one, or a copy that predates ``optim.seam``."""
    package = type(opt).__module__.split(".")[0]
    try:
        tools = importlib.import_module(f"{package}.optim.seam")
    except ImportError:
        return None
    return tools.captured_step_of(opt)


def _deviation(c: Contender, ref: Contender, evals, losses, start, ref_start) -> dict[str, float]:
    """Relative deviations of ``c`` from ``ref``: final losses, the loss fall, the worst norm."""
    fell, ref_fell = start - evals[c.name], ref_start - evals[ref.name]
    return {
        "training loss": abs(losses[c.name] - losses[ref.name]) / abs(losses[ref.name]),
        "batch-0 loss": abs(evals[c.name] - evals[ref.name]) / abs(evals[ref.name]),
        "loss fall": abs(fell - ref_fell) / abs(ref_fell),
        # a norm count that differs is reported by _check; here it is simply out of tolerance
        "norms": max(
            (abs(x - y) / max(abs(y), 1e-12) for x, y in zip(c.norms, ref.norms, strict=True)),
            default=0.0,
        )
        if len(c.norms) == len(ref.norms)
        else math.inf,
    }


def _check(
    args,
    contenders: list[Contender],
    start_loss: list[float],
    batches,
    noise: Contender,
    noise_start: float,
) -> None:
    """Fail unless every contender trained, and trained alike (within the noise band)."""
    ref = contenders[0]
    problems = []
    losses = {c.name: float(c.loss) for c in contenders + [noise]}  # type: ignore[arg-type]
    evals = {c.name: _eval_loss(c.model, batches[0]) for c in contenders + [noise]}
    band = _deviation(noise, ref, evals, losses, noise_start, start_loss[0])
    tol = {k: max(args.rtol, 3 * v) for k, v in band.items()}
    print(
        "noise band (stock/div vs stock, relative): "
        + ", ".join(f"{k} {v:.2e}" for k, v in band.items())
    )
    for c, start in zip(contenders, start_loss, strict=True):
        if c is not ref:
            dev = _deviation(c, ref, evals, losses, start, start_loss[0])
            print(
                f"{c.name} vs stock (relative): "
                + ", ".join(f"{k} {v:.2e}" for k, v in dev.items())
            )
            problems += [
                f"{c.name}: {k} deviates {v:.2e} from stock (tolerance {tol[k]:.2e})"
                for k, v in dev.items()
                if v > tol[k]
            ]
        if c.steps != ref.steps or len(c.norms) != ref.steps:
            problems.append(
                f"{c.name}: {c.steps} steps, {len(c.norms)} norms, expected {ref.steps}"
            )
        if not all(math.isfinite(v) for v in c.norms + [losses[c.name], evals[c.name]]):
            problems.append(f"{c.name}: non-finite norm or loss")
        if not evals[c.name] < start:
            problems.append(
                f"{c.name}: loss on batch 0 did not fall ({start:.4f} -> {evals[c.name]:.4f})"
            )
    first = ref.norms[0] if ref.norms else float("nan")
    print(
        f"check: {ref.steps} steps each; batch-0 loss {start_loss[0]:.4f} -> "
        + ", ".join(f"{k} {v:.6f}" for k, v in evals.items())
        + "; last training loss "
        + ", ".join(f"{k} {v:.6f}" for k, v in losses.items())
        + f"; grad norm step 1 {first:.4f}, last "
        + ", ".join(f"{c.name} {c.norms[-1]:.6f}" for c in contenders if c.norms)
        + f" (rtol {args.rtol:g}); clip acted on {sum(n > args.clip for n in ref.norms)}/"
        f"{len(ref.norms)} steps; "
        + ", ".join(
            f"{c.name}: {getattr(c.opt, 'fast_steps', '?')} fast steps, "
            f"{getattr(c.opt, 'clip_folds', '?')} clip folds"
            for c in contenders
            if c.kind != "stock"
        )
    )
    if problems:
        raise SystemExit("CHECK FAILED:\n  " + "\n  ".join(problems))
    print("check: OK")


if __name__ == "__main__":
    main()
