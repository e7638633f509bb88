"""mfsdp-optim demo: train a small mixture-of-experts transformer with FSDP2 and
FullyShardedOptimizer, checkpoint it, and resume on a different world size.

    python examples/demo.py                    # 4 CPU ranks (gloo), resume on 2; ~1-2 min
    python examples/demo.py --quick            # a shorter run (the test uses it)
    python examples/demo.py --loss-scale dynamic        # fp16 compute, dynamic loss scaling
    python examples/demo.py --muon             # Muon on the hidden matrices, AdamW on the rest
    python examples/demo.py --device cuda      # one rank per GPU, launched through torchrun

What it shows, in order:

1. *why*: dense grads live on a W-rank mesh, expert grads on 2-rank sub-meshes whose groups hold
   different experts. ``mfsdp_optim.get_grad_norm`` gives the exact global norm (checked against
   a brute-force norm over every unique ``full_tensor()``); ``torch.nn.utils.clip_grad_norm_``
   refuses the mix, and the usual per-mesh workaround gives each expert group a different answer.
2. *train*: W ranks, clipping, per-step loss / grad norm / zero grads / loss scale. With
   ``--muon``, one wrapper over two base optimizers: ``torch.optim.Muon`` for the blocks' 2-D
   matrices (attention, dense MLP, experts on their expert meshes) and AdamW for the rest.
3. *checkpoint* at step ``--save-at``: the model through ``get_model_state_dict`` and the optimizer
   through ``opt.sharded_state_dict()``, both written by ``mfsdp_optim.checkpoint.save_checkpoint``
   (DCP files, published only once every rank finished, with checksums).
4. *resume* on ``--resume-world-size`` ranks (default 2): the checkpoint is resharded on load and
   the loss continues where the uninterrupted run went; the comparison is printed.
5. *plot*: ``<out>/demo.png``, loss and grad norm of both runs.

Multi-node / explicit torchrun: run the two phases yourself, e.g.
``torchrun --nproc-per-node 8 examples/demo.py --device cuda --phase train`` then
``torchrun --nproc-per-node 4 examples/demo.py --device cuda --phase resume``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _moe import ModelConfig, MoETransformer, global_batch, make_rule  # noqa: E402

GLOBAL_BATCH = 32  # sequences per step, split over the ranks (so any world size sees the same)
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # max |loss diff| resumed vs uninterrupted
# --muon: torch's Muon orthogonalises in bfloat16, so the grads' last-bit differences (summed in
# another order on the resumed ranks) now and then round differently and the two runs drift
# apart slowly (1.7e-3 after 100 fp32 steps, where AdamW alone stays within 3e-8). The first
# resumed steps still hold the restored params and optimizer state to TOLERANCE.
MUON_TOLERANCE = 1e-2
EARLY_STEPS = 3


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (default 200; 40 with --quick)"
    )
    p.add_argument(
        "--save-at",
        type=int,
        default=None,
        help="checkpoint after this many steps and resume from it (default: steps/2)",
    )
    p.add_argument("--quick", action="store_true", help="a short run: 40 steps, save at 20")
    p.add_argument("--world-size", type=int, default=4, help="ranks of the first run (CPU)")
    p.add_argument(
        "--resume-world-size", type=int, default=2, help="ranks of the resumed run (CPU)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--loss-scale",
        choices=["none", "dynamic"],
        default="none",
        help="dynamic: DynamicGradScaler, skips steps whose grads overflow",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="compute dtype (FSDP2 MixedPrecisionPolicy); default fp32, or fp16 with "
        "--loss-scale dynamic",
    )
    p.add_argument("--clip", type=float, default=1.0, help="clip the global grad norm to this")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (peak)")
    p.add_argument(
        "--muon",
        action="store_true",
        help="torch.optim.Muon for the hidden 2-D matrices (attention, MLPs, experts), AdamW "
        "for the rest, in one FullyShardedOptimizer",
    )
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon's lr (peak), with --muon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo_out", help="checkpoint, metrics and plot go here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument(
        "--phase",
        choices=["all", "train", "resume"],
        default="all",
        help="under torchrun: which phase this launch runs (default: train, or "
        "resume if --phase resume)",
    )
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 40 if args.quick else 200
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 0 < args.save_at < args.steps:
        p.error(f"--save-at must be in (0, --steps={args.steps}), got {args.save_at}")
    if args.precision is None:
        args.precision = "fp16" if args.loss_scale == "dynamic" else "fp32"
    args.out = os.path.abspath(args.out)
    return args


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


# ---------------------------------------------------------------------------------------------
# per-rank setup


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """What ``--muon`` gives Muon: the 2-D weights inside the blocks (attention, dense MLP,
    experts). Embeddings, head, norms, biases and the small router stay on AdamW."""
    return p.dim() == 2 and name.startswith("layers.") and ".router." not in name


class Ctx:
    """Everything a rank needs: device, meshes, model, optimizer, scheduler."""

    def __init__(self, args: argparse.Namespace):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

        self.args = args
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if args.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.ep = 2 if self.world % 2 == 0 else 1
        self.edp = self.world // self.ep
        dev = self.device.type
        self.dense_mesh = init_device_mesh(dev, (self.world,), mesh_dim_names=("dp",))
        self.moe_mesh = init_device_mesh(dev, (self.ep, self.edp), mesh_dim_names=("ep", "edp"))
        ep_rank = self.moe_mesh.get_local_rank("ep")
        ep_group = self.moe_mesh.get_group("ep") if self.ep > 1 else None

        cfg = self.cfg = ModelConfig()
        model = MoETransformer(cfg, ep_rank, self.ep, ep_group, seed=args.seed).to(self.device)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        mp = MixedPrecisionPolicy(param_dtype=dtype[args.precision], reduce_dtype=torch.float32)
        for experts in model.expert_modules():
            fully_shard(experts, mesh=self.moe_mesh["edp"], mp_policy=mp)
            # FSDP averages expert grads over the edp ranks only, but each expert saw the tokens
            # of the whole ep group: divide by the world size, so every grad is the gradient of
            # the global mean loss (as for the dense params)
            experts.set_gradient_divide_factor(float(self.world))
            # gloo has no PREMUL_SUM: reduce with SUM, then divide. (Not on a 1-rank edp mesh:
            # there torch 2.13 would divide twice.)
            experts.set_force_sum_reduction_for_comms(self.edp > 1)
        for layer in model.layers:
            fully_shard(layer, mesh=self.dense_mesh, mp_policy=mp)
        fully_shard(model, mesh=self.dense_mesh, mp_policy=mp)
        self.model = model

        adamw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
        base: torch.optim.Optimizer | list[torch.optim.Optimizer]
        if args.muon:
            # Muon orthogonalises each 2-D update as a whole matrix; the wrapper computes it on
            # the whole matrix (one exchange per step), also for experts on their own meshes
            hidden = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
            rest = [p for n, p in model.named_parameters() if not is_hidden_matrix(n, p)]
            base = [
                torch.optim.Muon(hidden, lr=args.muon_lr, momentum=0.95, weight_decay=0.01),
                torch.optim.AdamW(rest, **adamw),
            ]
        else:
            base = torch.optim.AdamW(model.parameters(), **adamw)
        scaler = None
        if args.loss_scale == "dynamic":
            # starts too high on purpose: the first steps overflow in fp16 and are skipped on
            # every rank; the scale backs off, then tries to grow every 50 clean steps
            scaler = DynamicGradScaler(2.0**20, growth_interval=50, hysteresis=1)
        self.opt = FullyShardedOptimizer(
            base,
            OptimizerConfig(clip_grad=args.clip, log_num_zeros_in_grad=True),
            grad_scaler=scaler,
            model_chunks=[model],
        )
        warmup, total = min(10, max(1, args.steps // 4)), args.steps

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            done = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor)
        self.rule = make_rule(cfg.vocab, args.seed)

    def optimizer_line(self) -> str:
        """``--muon``: which params each base optimizer of the one wrapper steps."""
        muon, adamw = self.opt.optimizers
        names = {p: n for n, p in self.model.named_parameters()}
        hidden = [names[p] for g in muon.param_groups for p in g["params"]]
        experts = sum(".experts." in n for n in hidden)
        n_rest = sum(len(g["params"]) for g in adamw.param_groups)
        return (
            f"optimizers: one FullyShardedOptimizer over torch.optim.Muon ({len(hidden)} hidden "
            f"matrices, {experts} of them this rank's experts on their (edp={self.edp},) meshes; "
            f"lr {self.args.muon_lr}) and torch.optim.AdamW ({n_rest} params: embeddings, head, "
            f"norms, biases, router; lr {self.args.lr}): one global norm, clip and skip"
        )

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(step, self.rule, GLOBAL_BATCH, self.cfg.seq, self.args.seed)
        per = GLOBAL_BATCH // self.world
        sl = slice(self.rank * per, (self.rank + 1) * per)
        return x[sl].to(self.device), y[sl].to(self.device)

    def forward_backward(self, step: int, scaled: bool = True) -> torch.Tensor:
        """One forward and backward on this rank's share of ``step``'s batch; returns the LM loss
        (this rank's mean; ranks hold equal token counts, so the global loss is their mean)."""
        x, y = self.local_batch(step)
        logits, aux = self.model(x)
        # the first target is random (no rule yet): leave it out
        lm = F.cross_entropy(logits[:, 1:].float().flatten(0, 1), y[:, 1:].flatten())
        loss = lm + self.cfg.aux_loss * aux
        (self.opt.scale_loss(loss) if scaled else loss).backward()
        return lm.detach()

    def global_mean(self, value: torch.Tensor) -> float:
        t = value.detach().to(torch.float32).reshape(1).clone()
        dist.all_reduce(t)
        return float(t) / self.world

    def print0(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# stage 1: why


def why_stage(ctx: Ctx) -> None:
    """The global grad norm over dense + expert grads: this package, brute force, and torch."""
    import mfsdp_optim

    model, opt = ctx.model, ctx.opt
    ctx.forward_backward(step=0, scaled=False)
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    grads = [p.grad for _, p in named]
    ours = float(mfsdp_optim.get_grad_norm(grads))

    # brute force: every unique global tensor once, from full_tensor(). Dense grads are the same
    # on every rank; each ep group holds different experts (same shapes), so gather the expert
    # tensors of one rank per group (edp coordinate 0).
    dense_full = [p.grad.full_tensor().float().flatten() for n, p in named if ".experts." not in n]
    expert_full = torch.cat(
        [p.grad.full_tensor().float().flatten() for n, p in named if ".experts." in n]
    )
    everyone_experts = [torch.empty_like(expert_full) for _ in range(ctx.world)]
    dist.all_gather(everyone_experts, expert_full)
    one_per_group = [everyone_experts[int(r)] for r in ctx.moe_mesh.mesh[:, 0]]
    brute = float(torch.cat(dense_full + one_per_group).double().norm())
    n_expert = ctx.ep * sum(".experts." in n for n, _ in named)

    # torch's own clipping on the same grads
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        torch_says = "accepted (!)"
    except Exception as exc:  # noqa: BLE001 - we print what torch says
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        torch_says = f"refuses: {type(exc).__name__}: {first.split(', but')[0][:100]}"

    # the usual workaround: one torch norm per mesh, combined by hand
    dense = [p.grad for n, p in named if ".experts." not in n]
    expert = [p.grad for n, p in named if ".experts." in n]
    d = torch.nn.utils.get_total_norm(dense)
    e = torch.nn.utils.get_total_norm(expert)
    d = d.full_tensor() if hasattr(d, "full_tensor") else d
    e = e.full_tensor() if hasattr(e, "full_tensor") else e
    per_mesh = float(torch.sqrt(d.float() ** 2 + e.float() ** 2))
    mine = torch.tensor([ours, per_mesh], dtype=torch.float64)
    everyone_t = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(everyone_t, mine)
    everyone = [tuple(t.tolist()) for t in everyone_t]

    if ctx.rank == 0:
        ep, edp = ctx.ep, ctx.edp
        agree = all(math.isclose(o, everyone[0][0], rel_tol=0, abs_tol=0) for o, _ in everyone)
        print(
            f"why: one global grad norm over dense grads (fully_shard over {ctx.world} ranks) "
            f"and expert grads ({ep} groups of {edp} ranks, each group holding different "
            f"experts; {n_expert} expert tensors in all)"
        )
        print(
            f"  mfsdp_optim.get_grad_norm             {ours:.6f}   (identical on all "
            f"{ctx.world} ranks: {'yes' if agree else 'NO'}; one collective)"
        )
        print(
            f"  brute force over every full_tensor()  {brute:.6f}   "
            f"(rel. diff {abs(ours - brute) / brute:.1e})"
        )
        print(f"  torch.nn.utils.clip_grad_norm_        {torch_says}")
        per = ", ".join(f"rank {r}: {v:.4f}" for r, (_, v) in enumerate(everyone))
        print(
            f"  per-mesh get_total_norm, combined     {per}  "
            "(each ep group sees only its own experts)"
        )
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------
# stages 2-4: train, checkpoint, resume


def checkpoint_path(args: argparse.Namespace) -> str:
    return os.path.join(args.out, f"ckpt_step{args.save_at}")


def save_checkpoint(ctx: Ctx, step: int) -> float:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mfsdp_optim import checkpoint

    t0 = time.perf_counter()
    path = checkpoint_path(ctx.args)
    state = {
        "model": get_model_state_dict(ctx.model),
        "optimizer": ctx.opt.sharded_state_dict(),
        "extra": {
            "step": step,
            "scheduler": ctx.sched.state_dict(),
            "grad_scaler": ctx.opt.grad_scaler_state_dict(),
        },
    }
    # staged, then published once every rank finished: a crash mid-save never leaves a
    # directory that looks finished
    checkpoint.save_checkpoint(state, path, overwrite=True)
    return time.perf_counter() - t0


def load_checkpoint(ctx: Ctx) -> int:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from mfsdp_optim import checkpoint

    state = {
        "model": get_model_state_dict(ctx.model),
        "optimizer": ctx.opt.sharded_state_dict(is_loading=True),
        "extra": {
            "step": -1,
            "scheduler": ctx.sched.state_dict(),
            "grad_scaler": ctx.opt.grad_scaler_state_dict(),
        },
    }
    # verified (marker, sizes, checksums) before a byte is loaded; resharded by DCP
    checkpoint.load_checkpoint(state, checkpoint_path(ctx.args))
    set_model_state_dict(ctx.model, state["model"])
    ctx.opt.load_state_dict(state["optimizer"])
    ctx.sched.load_state_dict(state["extra"]["scheduler"])
    ctx.opt.load_grad_scaler_state_dict(state["extra"]["grad_scaler"])
    return int(state["extra"]["step"])


def _progress(ctx: Ctx, start: int, stop: int, desc: str):
    """A tqdm bar on rank 0 (plain log lines when tqdm is missing or --no-progress)."""
    if ctx.rank != 0 or ctx.args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=stop - start,
        initial=0,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
        file=sys.stderr,
    )


def train(ctx: Ctx, start: int, stop: int, save_at: int | None, desc: str) -> dict:
    args, opt = ctx.args, ctx.opt
    hist: dict = {
        "world_size": ctx.world,
        "mesh": f"dense ({ctx.world},), experts (ep={ctx.ep}, edp={ctx.edp})",
        "precision": args.precision,
        "optimizers": [type(o).__name__ for o in opt.optimizers],
        "start": start,
        "step": [],
        "loss": [],
        "grad_norm": [],
        "zeros": [],
        "loss_scale": [],
        "skipped": [],
    }
    bar = _progress(ctx, start, stop, desc)
    log_every = max(1, (stop - start) // 8)
    t0 = time.perf_counter()
    for step in range(start, stop):
        if save_at is not None and step == save_at:
            secs = save_checkpoint(ctx, step)
            msg = (
                f"  checkpoint: step {step} -> {checkpoint_path(args)} ({secs:.2f} s; model "
                "via get_model_state_dict, optimizer via opt.sharded_state_dict())"
            )
            (bar.write(msg) if bar else ctx.print0(msg))
        scale = float(opt.get_loss_scale())
        lm = ctx.forward_backward(step)
        ok, grad_norm, zeros = opt.step()
        opt.zero_grad()
        ctx.sched.step()
        loss = ctx.global_mean(lm)
        for k, v in (
            ("step", step),
            ("loss", loss),
            ("grad_norm", grad_norm),
            ("zeros", zeros),
            ("loss_scale", scale),
            ("skipped", not ok),
        ):
            hist[k].append(v)
        if ctx.rank == 0:
            line = (
                f"step {step:4d} | loss {loss:.4f} | grad norm {grad_norm:8.4f} | "
                f"zeros {zeros:5d} | loss scale {scale:g}" + ("" if ok else " | SKIPPED")
            )
            if bar:
                bar.set_postfix_str(
                    f"loss {loss:.3f} gnorm {grad_norm:.3f} zeros {zeros} scale {scale:g}",
                    refresh=False,
                )
                bar.update(1)
                if (step - start) % log_every == 0 or step == stop - 1 or not ok:
                    bar.write(line)
            elif (step - start) % log_every == 0 or step == stop - 1 or not ok:
                print(line, flush=True)
    if bar:
        bar.close()
    hist["seconds"] = time.perf_counter() - t0
    return hist


def run_phase(args: argparse.Namespace, phase: str) -> None:
    """One phase on this rank (the process group is up)."""
    ctx = Ctx(args)
    os.makedirs(args.out, exist_ok=True)
    if phase == "train":
        ctx.print0(
            f"\n== train: {ctx.world} ranks ({args.device}), dense params on "
            f"({ctx.world},), experts on (ep={ctx.ep}, edp={ctx.edp}); "
            f"{args.precision}, clip {args.clip}, loss scale {args.loss_scale}"
        )
        if args.muon:
            ctx.print0(ctx.optimizer_line())
        why_stage(ctx)
        ctx.print0("")
        hist = train(ctx, 0, args.steps, save_at=args.save_at, desc=f"train  x{ctx.world}")
    else:
        start = load_checkpoint(ctx)
        ctx.print0(
            f"\n== resume: {ctx.world} ranks ({args.device}), experts on (ep={ctx.ep}, "
            f"edp={ctx.edp}); loaded {checkpoint_path(args)} (saved by a different "
            f"world size), continuing at step {start}"
        )
        hist = train(ctx, start, args.steps, save_at=None, desc=f"resume x{ctx.world}")
    if ctx.rank == 0:
        with open(os.path.join(args.out, f"metrics_{phase}.json"), "w") as f:
            json.dump(hist, f)
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# stage 5: compare and plot (one process)


def compare_and_plot(args: argparse.Namespace) -> bool:
    with open(os.path.join(args.out, "metrics_train.json")) as f:
        a = json.load(f)
    with open(os.path.join(args.out, "metrics_resume.json")) as f:
        b = json.load(f)
    first = b["start"]
    ref = dict(zip(a["step"], a["loss"], strict=True))
    rows = [(s, ref[s], lb) for s, lb in zip(b["step"], b["loss"], strict=True)]
    diffs = [abs(la - lb) for _, la, lb in rows]
    tol = TOLERANCE[args.precision]
    worst = max(diffs)
    early = max(diffs[:EARLY_STEPS])
    early_ok = True
    if args.muon:
        early_ok = early <= tol
        tol = max(tol, MUON_TOLERANCE)
    ok = worst <= tol and early_ok
    wa, wb = a["world_size"], b["world_size"]
    print(
        f"\n== resume check: steps {first}..{args.steps - 1}, uninterrupted on {wa} ranks vs "
        f"resumed on {wb} ranks from the step-{first} checkpoint"
    )
    print(f"  {'step':>5}  {f'loss x{wa}':>10}  {f'loss x{wb}':>10}  {'|diff|':>8}")
    show = sorted({0, 1, 2, len(rows) // 2, len(rows) - 2, len(rows) - 1} & set(range(len(rows))))
    for i in show:
        s, la, lb = rows[i]
        print(f"  {s:>5}  {la:>10.6f}  {lb:>10.6f}  {abs(la - lb):>8.1e}")
    print(
        f"  loss at step 0: {a['loss'][0]:.4f}; at step {first} (first resumed step): "
        f"{rows[0][2]:.4f}; at the end: {rows[-1][2]:.4f}"
    )
    if args.muon:
        print(
            f"  first {EARLY_STEPS} resumed steps: |loss diff| <= {early:.2e} (tolerance "
            f"{TOLERANCE[args.precision]:g}: the restored params and Muon/AdamW state); later "
            "steps drift slowly (Muon's Newton-Schulz runs in bfloat16, where the grads' "
            "last-bit differences sometimes round differently)"
        )
    print(f"  max |loss diff| = {worst:.2e} (tolerance {tol:g}): {'MATCH' if ok else 'MISMATCH'}")
    plot(args, a, b)
    return ok


def plot(args: argparse.Namespace, a: dict, b: dict) -> None:
    path = os.path.join(args.out, "demo.png")
    try:
        import matplotlib
    except ImportError:
        print("  plot: matplotlib is not installed, no PNG (pip install 'mfsdp-optim[demo]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "loss", "training loss (global mean)"),
        (axes[1], "grad_norm", "global grad norm (before clipping)"),
    ):
        ax.plot(a["step"], a[key], label=f"uninterrupted, {a['world_size']} ranks", lw=2)
        ax.plot(b["step"], b[key], "--", label=f"resumed, {b['world_size']} ranks", lw=2)
        ax.axvline(b["start"], color="grey", lw=1, ls=":")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[1].axhline(args.clip, color="red", lw=1, ls=":", label=f"clip at {args.clip:g}")
    axes[0].legend()
    axes[1].legend()
    fig.suptitle(
        f"mfsdp-optim demo: MoE transformer, FSDP2, {args.precision}"
        f"{', Muon + AdamW' if args.muon else ''}; "
        f"checkpoint at step {b['start']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  plot: {path}")


# ---------------------------------------------------------------------------------------------
# launching


def _rank_main(rank: int, world: int, init_file: str, args: argparse.Namespace, phase: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        run_phase(args, phase)
    finally:
        dist.destroy_process_group()


def spawn_phase(args: argparse.Namespace, phase: str, world: int) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    # a fork server that has imported torch once forks every rank of both phases (spawning
    # imports torch again in each rank: ~3 s of CPU apiece)
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor", "_moe"])
    with tempfile.TemporaryDirectory(prefix="mfsdp_demo_") as tmp:
        mp.start_processes(
            _rank_main,
            args=(world, os.path.join(tmp, "init"), args, phase),
            nprocs=world,
            start_method="forkserver",
            join=True,
        )


def torchrun_phase(args: argparse.Namespace, phase: str, nproc: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.abspath(__file__),
        *sys.argv[1:],
        "--phase",
        phase,
    ]
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if under_torchrun():
        phase = "train" if args.phase == "all" else args.phase
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cpu":
            torch.set_num_threads(1)
        dist.init_process_group(backend)
        try:
            run_phase(args, phase)
        finally:
            dist.destroy_process_group()
        if phase == "resume" and int(os.environ.get("RANK", "0")) == 0:
            return 0 if compare_and_plot(args) else 1
        return 0

    t0 = time.perf_counter()
    if os.path.isdir(checkpoint_path(args)):
        shutil.rmtree(checkpoint_path(args))
    if args.device == "cuda":
        n = torch.cuda.device_count()
        if n < 1:
            print("--device cuda: no GPU visible", file=sys.stderr)
            return 2
        torchrun_phase(args, "train", n)
        torchrun_phase(args, "resume", max(1, n // 2))
    else:
        print(
            f"mfsdp-optim demo: spawning {args.world_size} CPU ranks (gloo), then "
            f"{args.resume_world_size}; {args.steps} steps, checkpoint at {args.save_at}; "
            f"output in {args.out}",
            flush=True,
        )
        spawn_phase(args, "train", args.world_size)
        spawn_phase(args, "resume", args.resume_world_size)
        ok = compare_and_plot(args)
        print(f"\ndone in {time.perf_counter() - t0:.0f} s", flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
