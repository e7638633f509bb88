"""Torch-only reproducer: two functional collectives in flight on one gloo group corrupt the heap.

    python scripts/gloo_funcol_repro.py            # both all-gathers in flight, then waited
    python scripts/gloo_funcol_repro.py --serial   # each waited before the next is issued
    python scripts/gloo_funcol_repro.py --device cuda [--serial]  # CUDA tensors over gloo

Two CPU ranks, the default (world) gloo group, no code of this package. Each iteration issues
two ``torch.distributed._functional_collectives`` all-gathers; by default both are in flight
before either is waited for. With torch 2.13.0+cpu on a 2-core box (2026-12-07), a rank died
of ``malloc(): unaligned tcache chunk detected`` (or SIGSEGV) within seconds in 5 runs of 6;
with ``--serial``, 6 runs of 20,000 iterations each were clean. The same pattern in
the demo's expert-parallel layer made a demo rank die about once in ten runs of 300 steps
(docs/troubleshooting.md, "A CPU rank dies"). ``torch.distributed.all_gather_single(...,
async_op=True)`` with two works in flight did not fault in 39,000 iterations: the fault needs
the functional collectives' path. Exit status: 0 when every rank finished, else non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import _functional_collectives as funcol

# torch 2.13 renamed the functional all-gather (the old name still works, with a warning)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _rank(rank: int, world: int, init_file: str, iters: int, serial: bool, device: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    if device == "cuda":  # every rank on the machine's GPUs in turn (one GPU: all on it)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    for i in range(iters):
        rows = 32 + i % 5  # sizes vary, so freed blocks are reused for other sizes
        x = torch.full((rows, 64), float(rank), device=device)
        y = torch.full((rows, 64), float(rank + 10), device=device)
        if serial:
            a = funcol.wait_tensor(_all_gather(x, 0, group))
            b = funcol.wait_tensor(_all_gather(y, 0, group))
        else:
            pending = (_all_gather(x, 0, group), _all_gather(y, 0, group))
            a, b = (funcol.wait_tensor(t) for t in pending)
        want = torch.arange(world, dtype=x.dtype, device=device).repeat_interleave(rows)
        if not (torch.equal(a[:, 0], want) and torch.equal(b[:, 0], want + 10)):
            raise AssertionError(f"rank {rank}: wrong all-gather result at iteration {i}")
    print(f"rank {rank}: {iters} iterations, no fault", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serial", action="store_true", help="wait each collective before the next")
    p.add_argument("--iters", type=int, default=20_000, help="iterations per rank")
    p.add_argument("--device", default="cpu", help="where the tensors live: cpu or cuda")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(
                _rank,
                args=(2, os.path.join(d, "init"), args.iters, args.serial, args.device),
                nprocs=2,
                start_method="spawn",
            )
        except mp.ProcessExitedException as exc:
            print(f"a rank died: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
