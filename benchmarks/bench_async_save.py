"""The asynchronous save's blocking time against its device-to-host copy floor (one process).

A Llama 1.2B-like set of params (``bench_step.py``'s ``llama1b`` shapes) as DTensors on a 1-D
mesh of one rank, AdamW stepped once, so its state is two fp32 tensors per param. Measured:

  * the pinned device-to-host bandwidth (one 1 GiB copy into pinned host memory, best of 3), and
    the floor it gives for the state's bytes;
  * ``save_checkpoint(..., asynchronous=True)``'s blocking time (the call, the state dict built
    before it), the first save (the pinned buffers are allocated and pinned) and the following
    ones (reused), and the time until ``wait()`` returns;
  * the synchronous ``save_checkpoint`` of the same state, for the ratio.

Target (issue 38): the blocking time at most 1.5x the copy floor on the GPU.

Run::

    python benchmarks/bench_async_save.py                          # CUDA, the 1.2B set
    python benchmarks/bench_async_save.py --device cpu --scale 0.01 # a quick CPU smoke run
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _bandwidth(device: torch.device, pinned: bool) -> float:
    """Bytes per second of one 1 GiB device-to-host copy (best of 3)."""
    n = 1 << 28  # fp32 elements: 1 GiB
    src = torch.ones(n, device=device)
    dst = torch.empty(n, pin_memory=pinned)
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return n * 4 / best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="rows of the 2-D params times this")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    from bench_step import _llama1b
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim._infra.params import ParamRecord
    from mfsdp_optim.checkpoint import build_sharded_state_dict, save_checkpoint

    device = torch.device(args.device)
    tmp = tempfile.mkdtemp(prefix="bench_async_")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    model = torch.nn.Module()
    for i, shape in enumerate(_llama1b(args.scale, 1.0)):
        local = torch.randn(shape, device=device) * 0.02
        model.register_parameter(
            f"p{i}", torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    records = [ParamRecord(n, p, p) for n, p in model.named_parameters()]
    state_bytes = sum(
        v._local_tensor.numel() * v._local_tensor.element_size()
        for s in opt.state.values()
        for v in s.values()
        if v.dim() > 0
    )
    pinned = device.type == "cuda"
    bw = _bandwidth(device, pinned)
    floor = state_bytes / bw
    print(
        f"{len(records)} params, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} G "
        f"elements; AdamW state {state_bytes / 2**30:.2f} GiB on {device}; "
        f"{'pinned ' if pinned else ''}device-to-host {bw / 2**30:.1f} GiB/s: copy floor "
        f"{floor:.3f} s"
    )
    try:
        for i in range(args.saves):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            sd = {"optimizer": build_sharded_state_dict(opt, records)}
            t_built = time.perf_counter()
            handle = save_checkpoint(sd, f"{tmp}/async{i}", asynchronous=True)
            t_back = time.perf_counter()
            handle.wait()
            t_done = time.perf_counter()
            print(
                f"async save {i}: blocks {t_back - t_built:.3f} s "
                f"({(t_back - t_built) / floor:.2f}x the floor; with the build "
                f"{t_back - t:.3f} s), published after {t_done - t:.2f} s"
            )
            shutil.rmtree(f"{tmp}/async{i}", ignore_errors=True)
        t = time.perf_counter()
        save_checkpoint({"optimizer": build_sharded_state_dict(opt, records)}, f"{tmp}/sync")
        print(f"synchronous save: {time.perf_counter() - t:.2f} s")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
