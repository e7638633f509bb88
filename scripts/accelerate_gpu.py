"""The accelerate recipe on one CUDA GPU against stock AdamW under the same accelerate setup.

    PYTHONPATH=src python3 scripts/accelerate_gpu.py

World size 1 (the script sets torchrun's variables for one process: accelerate engages FSDP2
only with LOCAL_RANK set, on a CUDA-like device). Both runs use
``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` on the same token
model and batches, AdamW (foreach) clipped to 1.0, a clip that fires on some steps only:

* stock: ``accelerator.prepare(model, AdamW)``, ``accelerator.clip_grad_norm_``, ``step()``;
* recipe (``mfsdp_optim.integrations.accelerate``): ``shard``, wrap, ``prepare``; the wrapper
  clips; ``step()`` returns None and ``unwrap(optimizer).last_grad_norm`` is the norm;
* resume: the recipe saves with ``accelerator.save_state`` after half the steps, a fresh
  accelerator and fresh objects ``load_state`` it, and the second half must repeat the full
  run's bit for bit.

Prints a verdict table (date, card, torch and accelerate versions) and exits 1 if a row fails.
``compare()`` takes the Accelerator factory, so tests/integrations/test_accelerate.py runs the
same code on CPU ranks with accelerate's state switched to FSDP2.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

STEPS, CLIP, LR = 4, 1.0, 5e-2
VOCAB, DIM, BATCH, SEQ = 32, 16, 4, 8


def make_model(device: torch.device) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
        torch.nn.Linear(DIM, 2 * DIM),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * DIM, VOCAB),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.to(device)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """The step's loss on this rank's batch, made on the params' device (where sharding put
    them: the accelerator's device, or a GPU that ``fully_shard`` picked for a CPU accelerator)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))


def brute_norm(model: torch.nn.Module) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += g.double().square().sum().cpu()
    return float(total.sqrt())


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


def _fresh(make_accelerator: Callable[[], Any]) -> Any:
    from accelerate.state import AcceleratorState

    # a new Accelerator per run (its own models and optimizers): both of accelerate's states are
    # reset, since the AcceleratorState built over a kept PartialState of an earlier run may miss
    # its FSDP plugin (seen on one GPU, accelerate 1.15); the process group stays
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = make_accelerator()
    if not getattr(acc.state, "fsdp_plugin", None):
        print(f"accelerate state: {sorted(acc.state.__dict__)}", file=sys.stderr)
    return acc


def stock_run(make_accelerator: Callable[[], Any]) -> dict[str, Any]:
    acc = _fresh(make_accelerator)
    model = make_model(acc.device)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=True))
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(1, 2 * STEPS + 1):
        loss = loss_of(model, acc.process_index, step)
        acc.backward(loss)
        out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss))
    out["params"] = full_params(model)
    return out


def recipe_run(
    make_accelerator: Callable[[], Any],
    folder: str,
    first: int = 1,
    save_at: int | None = None,
    load: bool = False,
) -> dict[str, Any]:
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.integrations.accelerate import prepare, shard, unwrap

    acc = _fresh(make_accelerator)
    model = shard(acc, make_model(acc.device))
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    wrapper = FullyShardedOptimizer(adamw, OptimizerConfig(clip_grad=CLIP), model_chunks=[model])
    model, opt = prepare(acc, model, wrapper)
    if load:
        acc.load_state(folder)
    out: dict[str, Any] = {"losses": [], "norms": [], "brute": [], "returns": []}
    for step in range(first, 2 * STEPS + 1):
        loss = loss_of(model, acc.process_index, step)
        acc.backward(loss)
        out["brute"].append(brute_norm(model))
        out["returns"].append(opt.step())
        out["norms"].append(float(unwrap(opt).last_grad_norm))
        opt.zero_grad()
        out["losses"].append(float(loss))
        if step == save_at:
            acc.save_state(folder)
    out["params"] = full_params(model)
    return out


def refused_orders(make_accelerator: Callable[[], Any]) -> bool:
    """An unsharded model, and an optimizer that is not the wrapper, are refused before
    accelerate sees them."""
    from mfsdp_optim.integrations.accelerate import prepare, shard

    acc = _fresh(make_accelerator)
    plain = make_model(acc.device)
    sharded = shard(acc, make_model(acc.device))
    refused = []
    for model, error in ((plain, ValueError), (sharded, TypeError)):
        try:
            prepare(acc, model, torch.optim.AdamW(model.parameters()))
        except error:
            refused.append(True)
    return refused == [True, True]


def _rel(got: Any, want: Any) -> float:
    if isinstance(want, dict):
        return max(_rel(got[k], want[k]) for k in want)
    g = torch.as_tensor(got, dtype=torch.float64)
    w = torch.as_tensor(want, dtype=torch.float64)
    return float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))


def compare(make_accelerator: Callable[[], Any], folder: str) -> list[tuple[str, str, bool]]:
    """Every verdict row: (what, measured, passed)."""
    stock = stock_run(make_accelerator)
    full = recipe_run(make_accelerator, os.path.join(folder, "unused"))
    ckpt = os.path.join(folder, "state")
    recipe_run(make_accelerator, ckpt, save_at=STEPS)
    resumed = recipe_run(make_accelerator, ckpt, first=STEPS + 1, load=True)
    rows = []

    def row(what: str, err: float, limit: float) -> None:
        rows.append((what, f"{err:.2e} (limit {limit:g})", err <= limit))

    fired = max(stock["norms"]) > CLIP > min(stock["norms"])
    shown = ", ".join(f"{n:.2f}" for n in stock["norms"])
    rows.append(("the clip fires on some steps only", f"norms {shown}", fired))
    row("losses vs stock AdamW", _rel(full["losses"], stock["losses"]), 1e-6)
    row("params vs stock AdamW", _rel(full["params"], stock["params"]), 1e-6)
    row("logged norm vs brute force", _rel(full["norms"], full["brute"]), 1e-6)
    row("logged norm vs clip_grad_norm_", _rel(full["norms"], stock["norms"]), 1e-6)
    returns_none = all(r is None for r in full["returns"])
    rows.append(("accelerate's step() returns None", str(returns_none), returns_none))
    row("resumed losses (save/load_state)", _rel(resumed["losses"], full["losses"][STEPS:]), 0)
    row("resumed params (save/load_state)", _rel(resumed["params"], full["params"]), 0)
    ok = refused_orders(make_accelerator)
    rows.append(("unsharded model / unwrapped optimizer refused", str(ok), ok))
    return rows


def _one_process_env() -> None:
    """torchrun's variables for one process (accelerate's FSDP2 needs LOCAL_RANK)."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: accelerate engages FSDP2 only on CUDA-like devices")
        return 2
    import accelerate
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    _one_process_env()
    # the same bits on every run of the same step (the resumed rows compare bit for bit)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)

    def make() -> Any:
        return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))

    with tempfile.TemporaryDirectory() as folder:
        rows = compare(make, folder)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{when}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"accelerate {accelerate.__version__}, world size 1"
    )
    width = max(len(r[0]) for r in rows)
    for what, measured, passed in rows:
        print(f"{'PASS' if passed else 'FAIL'}  {what:<{width}}  {measured}")
    ok = all(r[2] for r in rows)
    print("verdict:", "the recipe trains like stock AdamW and resumes exactly" if ok else "FAILED")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
