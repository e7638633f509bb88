"""The asynchronous save's blocking time against its device-to-host copy floor (one process).

A Llama 1.2B-like set of params (``bench_step.py``'s ``llama1b`` shapes) as DTensors on a 1-D
mesh of one rank, AdamW stepped once, so its state is two fp32 tensors per param. Measured, in
one run:

  * the floor: the pinned device-to-host bandwidth (one 1 GiB copy into pinned host memory, best
    of 3), and the time it gives for the state's bytes;
  * prepared (first in the process): ``prepare_async_save`` on a background thread while a
    stand-in for training (a run of device matmuls, timed alone first) keeps the device busy:
    how long the preparation took and how much it slowed the stand-in; then the first
    ``save_checkpoint(..., asynchronous=True)`` and the later ones;
  * unprepared, for comparison: the buffers dropped, then one save that makes (and
    page-locks) them inside the call, as a first save without the preparation does;
  * the host memory the buffers hold against the state's bytes (one copy), and the synchronous
    ``save_checkpoint`` of the same state;
  * on CUDA, last: page-locking as many bytes on a background thread in seven ways (torch's
    binding, the package's call on the whole, the same on pages faulted in first, and the
    package's own buffer in pieces: as a preparation locks it, and three other pieces and
    pauses), with the stand-in for training run over and over beside each
    (``_register_probe``).

Each save's blocking time is the call alone (the state dict is built before it). Target (issue
46): every save, the first included, at most 1.5x the floor on the GPU; one copy of host memory.

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


def _bandwidth(device: torch.device, pinned: bool, registered: bool = False) -> float:
    """Bytes per second of one 1 GiB device-to-host copy (best of 3): into pinned memory
    (torch's allocator), into pageable memory page-locked with ``cudaHostRegister``
    (``registered``: what the asynchronous save's buffers are), or into pageable memory."""
    n = 1 << 28  # fp32 elements: 1 GiB
    src = torch.ones(n, device=device)
    dst = torch.empty(n, pin_memory=pinned and not registered)
    if registered:
        torch.cuda.cudart().cudaHostRegister(dst.data_ptr(), n * 4, 1)
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    if registered:
        torch.cuda.cudart().cudaHostUnregister(dst.data_ptr())
    return n * 4 / best


def _stand_in(device: torch.device, iters: int) -> tuple:
    """A stand-in for training: ``iters`` bf16 matmuls (CPU: float32, smaller); returns the
    run as a callable that waits for the device and its duration alone."""
    n = 4096 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(n, n, device=device, dtype=dtype)

    def run() -> float:
        t = time.perf_counter()
        for _ in range(iters):
            torch.mm(x, x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run()  # warm
    return run, min(run() for _ in range(3))


def _register_probe(nbytes: int, run, alone: float) -> None:
    """How much page-locking ``nbytes`` of fresh pageable memory on a background thread slows
    the stand-in for training, for each way of calling ``cudaHostRegister``: torch's bindings
    (which hold the GIL for the call), the package's (ctypes: the GIL let go), the package's
    after the pages are faulted in by a ``zero_()`` (torch lets go of the GIL in it), and the
    package's own buffer (``seam.locked_host_buffer``) as a preparation locks it (64 MiB pieces,
    1 ms apart) and with other pieces and pauses, to choose them from. The stand-in runs again
    and again until the locking is done; each line: the locking's time, and the stand-in's runs
    beside it (their median and the slowest against one run alone)."""
    import statistics
    import threading

    from mfsdp_optim.checkpoint.seam import locked_host_buffer, page_locker

    rt, ours = torch.cuda.cudart(), page_locker()

    def whole_torch(buf: torch.Tensor, n: int) -> list[int]:
        assert int(rt.cudaHostRegister(buf.data_ptr(), n, 1)) == 0
        return [buf.data_ptr()]

    def whole_ours(buf: torch.Tensor, n: int) -> list[int]:
        assert ours.register(buf.data_ptr(), n, 1) == 0
        return [buf.data_ptr()]

    def touched_ours(buf: torch.Tensor, n: int) -> list[int]:
        buf.zero_()
        return whole_ours(buf, n)

    kept: list = []

    def package(piece: int | None, pause: float | None):
        def lock(buf: torch.Tensor, n: int) -> list[int]:  # the package's own buffer
            kept.append(locked_host_buffer(n // 4, pause=pause, piece=piece))
            return []  # released (every piece unlocked) after the run

        return lock

    print(
        f"page-locking {nbytes / 2**30:.2f} GiB on a background thread (ours: gil_free="
        f"{ours.gil_free}); the stand-in alone {alone:.3f} s"
    )
    for name, how in (
        ("torch bindings", whole_torch),
        ("ours, whole", whole_ours),
        ("ours, pages touched first", touched_ours),
        ("the package's buffer as it is (64 MiB pieces, 1 ms apart)", package(None, None)),
        ("the package's buffer, 64 MiB pieces back to back", package(64 << 20, 0.0)),
        ("the package's buffer, 256 MiB pieces, 1 ms apart", package(256 << 20, 0.001)),
        ("the package's buffer, 1 GiB pieces back to back", package(1 << 30, 0.0)),
    ):
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
        took: list[float] = []
        ptrs: list[int] = []

        def lock(how, buf: torch.Tensor, took: list[float], ptrs: list[int]) -> None:
            t = time.perf_counter()
            ptrs.extend(how(buf, nbytes - nbytes % 4))
            took.append(time.perf_counter() - t)

        th = threading.Thread(target=lock, args=(how, buf, took, ptrs))
        th.start()
        runs = [run()]
        while th.is_alive():
            runs.append(run())
        th.join()
        for ptr in ptrs:
            ours.unregister(ptr)
        for locked in kept:
            locked.release()
        kept.clear()
        del buf
        print(
            f"  {name}: locked in {took[0]:.3f} s; {len(runs)} stand-in runs beside it, median "
            f"{statistics.median(runs) / alone:.2f}x alone, slowest {max(runs) / alone:.2f}x"
        )


def _save(sd, path: str, floor: float) -> float:
    """One asynchronous save of ``sd``: its blocking time (waited for, then removed)."""
    from mfsdp_optim.checkpoint import save_checkpoint

    t = time.perf_counter()
    handle = save_checkpoint(sd, path, asynchronous=True)
    blocked = time.perf_counter() - t
    handle.wait()
    shutil.rmtree(path, ignore_errors=True)
    return blocked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="rows of the 2-D params times this")
    ap.add_argument("--saves", type=int, default=3, help="prepared saves (the first included)")
    ap.add_argument("--iters", type=int, default=200, help="matmuls of the training stand-in")
    args = ap.parse_args()
    from bench_step import _llama1b
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.checkpoint import (
        ParamRecord,
        build_sharded_state_dict,
        prepare_async_save,
        save_checkpoint,
    )
    from mfsdp_optim.checkpoint.seam import host_buffer_bytes, release_host_buffers

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
    if pinned:
        reg = _bandwidth(device, pinned, registered=True)
        print(f"into registered (cudaHostRegister) memory: {reg / 2**30:.1f} GiB/s")

    def state():
        return {"optimizer": build_sharded_state_dict(opt, records)}

    try:
        # prepared on a background thread while the stand-in for training runs (first in the
        # process, so its first save pays what any first save pays: the background's group)
        release_host_buffers()
        sd = state()
        run, alone = _stand_in(device, args.iters)
        t = time.perf_counter()
        prep = prepare_async_save(sd)
        beside = run()
        prep.wait()
        took = time.perf_counter() - t
        print(
            f"prepare_async_save (background): {took:.3f} s until done, {prep.nbytes / 2**30:.2f} "
            f"GiB; the stand-in for training took {beside:.3f} s beside it, {alone:.3f} s alone "
            f"({beside / alone:.2f}x)"
        )
        blocked = []
        for i in range(args.saves):
            sd = state()
            blocked.append(_save(sd, f"{tmp}/async{i}", floor))
            which = "first" if i == 0 else f"save {i}"
            print(
                f"prepared {which}: blocks {blocked[-1]:.3f} s "
                f"({blocked[-1] / floor:.2f}x the floor)"
            )
        held = host_buffer_bytes()
        print(
            f"host buffers held: {held / 2**30:.3f} GiB for {state_bytes / 2**30:.3f} GiB of "
            f"state tensors ({held / state_bytes:.3f}x; the state dict's other tensors included)"
        )
        # unprepared, for comparison: the buffers dropped, then made inside the save
        release_host_buffers()
        cold = _save(state(), f"{tmp}/cold", floor)
        print(f"unprepared first save: blocks {cold:.3f} s ({cold / floor:.2f}x the floor)")
        later = blocked[1:] or blocked
        print(
            f"summary: first save {blocked[0] / floor:.2f}x the floor (unprepared "
            f"{cold / floor:.2f}x), later saves {max(later) / floor:.2f}x at most "
            "(target: every save <= 1.5x)"
        )
        t = time.perf_counter()
        save_checkpoint(state(), f"{tmp}/sync")
        print(f"synchronous save: {time.perf_counter() - t:.2f} s")
        if pinned:
            release_host_buffers()
            _register_probe(state_bytes, run, alone)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
