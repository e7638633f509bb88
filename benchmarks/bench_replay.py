#!/usr/bin/env python
"""Host time of one replay of the captured step (``OptimizerConfig(cuda_graph=True)``), per tensor.

One process, world size 1 (gloo on CPU, nccl on CUDA, FileStore rendezvous), torch's fused AdamW
over N DTensor params (``--shape``, default 4x4: the device work is negligible) with clipping
and ``host_sync=False``, for N in ``--counts`` (default 300, 3000, 30000). Per count, after a
steady capture, the median over ``--iters`` rounds (the contenders alternate within a round, so
a slow spell of a shared host hits them alike; the device drained before each timed call) of

* ``step``: the host time of one ``wrapper.step()`` call: everything a replay does on the host
  (the wrapper's and torch's step wrappers, the lr mirror, the validity check, the graph launch,
  the host-side bookkeeping, the clone of the returned tensors);
* ``check``: the validity check alone (``CapturedStep.still_valid``);
* ``launch`` (CUDA only): the graph's replay alone;

for these contenders, in one run: ``before``, the check as it stood before its one-pass
rewrite (main 2cb5d8f: four C-level passes over the params, the grads' addresses by torch's C++
loop where the build has it), kept below as ``_Before``; ``now``, the package's (one Python
loop reading each param's objects together); with ``--compare``, ``prev``, the whole step of
another copy of the package (e.g. the previous main, renamed: its step wrapper too; a commit
with ``mfsdp_optim.optim.seam``, which the benchmark reaches it through); with
``--native``, the per-param check compiled as C++ (an evaluation of what compiled code would
cost, not the package's). ``step - check`` is the part that does not grow with N. On CPU no
graph exists: the runner replays nothing and hands back the warm-up step's tensors, so ``step``
is the host bookkeeping only (what a CUDA replay adds: the launch, CUDA clones).

    python benchmarks/bench_replay.py                        # CPU: the host bookkeeping
    python benchmarks/bench_replay.py --device cuda          # with the CUDA graph
    python benchmarks/bench_replay.py --counts 300,3000 --iters 50
    python benchmarks/bench_replay.py --compare mfsdp_prev=/tmp/prev --native  # beside main
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time
import types
from operator import attrgetter
from operator import is_ as _is
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import mfsdp_optim
from mfsdp_optim.optim import seam
from mfsdp_optim.optim.seam import CapturedStep, Inputs

_grad_of = attrgetter("grad")
_local_of = attrgetter("_local_tensor")


class _NoLaunch:
    """CPU stand-in for the CUDA graph: ``warm`` runs the step, ``capture`` records nothing and
    ``replay`` returns the warm-up step's tensors (the host bookkeeping of a replay, no launch)."""

    def __init__(self) -> None:
        self.out: Any = None
        self.captures = 0

    def warm(self, body):
        self.out = body()
        return self.out

    def capture(self, body) -> None:
        self.captures += 1

    def replay(self):
        return self.out

    def reset(self) -> None:
        pass


class _Before(CapturedStep):
    """The captured step with the validity check as it stood before the one-pass rewrite
    (main 2cb5d8f, verbatim): the same reads, one C-level pass each (grads, the grads' local
    tensors, the params' local tensors by identity, then the grads' local addresses)."""

    def still_valid(self, captured: Inputs) -> bool:
        if not captured.same_head(self.inputs(lists=False)):
            return False
        check_all = seam.check_all_lists()
        i = 0
        with torch._C.DisableTorchFunctionSubclass():
            for e in self.engines:
                plan = e.preparer.plan
                if plan is None:
                    continue
                params, grads, grad_locals, locals_ = captured.lists[4 * i : 4 * i + 4]
                grad_ptrs, local_ptrs = captured.addresses[2 * i : 2 * i + 2]
                i += 1
                if not (
                    params is plan.params
                    and all(map(_is, map(_grad_of, params), grads))
                    and all(map(_is, map(_local_of, grads), grad_locals))
                    and all(map(_is, map(_local_of, params), locals_))
                    and seam.same_addresses(grad_locals, grad_ptrs)
                    and (not check_all or seam.same_addresses(locals_, local_ptrs))
                ):
                    return False
        return True


_NATIVE_SRC = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <structmember.h>

// The one-pass check of CapturedStep._unmoved in C++ (evaluation only): for every i,
// params[i].grad is grads[i], grads[i]._local_tensor is gls[i], params[i]._local_tensor is
// pls[i], gls[i] starts at ptrs[i]. descr: DTensor's _local_tensor slot (its offset).
bool unmoved(py::list params, py::list grads, py::list gls, py::list pls, at::Tensor ptrs,
             py::handle descr) {
  const Py_ssize_t off = reinterpret_cast<PyMemberDescrObject*>(descr.ptr())->d_member->offset;
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  const int64_t* want = ptrs.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    PyObject* g = PyList_GET_ITEM(grads.ptr(), i);
    const at::Tensor& grad = THPVariable_Unpack(p).grad();
    if (!grad.defined() ||
        grad.unsafeGetTensorImpl() != THPVariable_Unpack(g).unsafeGetTensorImpl())
      return false;
    PyObject* gl = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(g) + off);
    PyObject* pl = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(p) + off);
    if (gl != PyList_GET_ITEM(gls.ptr(), i) || pl != PyList_GET_ITEM(pls.ptr(), i)) return false;
    if (reinterpret_cast<int64_t>(THPVariable_Unpack(gl).const_data_ptr()) != want[i])
      return false;
  }
  return true;
}
"""


def _native_module() -> Any:
    """The C++ check above, built with torch.utils.cpp_extension (needs a C++ compiler and
    ninja; about 20 s the first time, then cached)."""
    from torch.utils.cpp_extension import load_inline

    if not isinstance(DTensor.__dict__.get("_local_tensor"), types.MemberDescriptorType):
        raise RuntimeError("DTensor._local_tensor is not a slot in this torch")
    return load_inline("mfsdp_bench_native_check", cpp_sources=[_NATIVE_SRC], functions=["unmoved"])


class _Native(CapturedStep):
    """The captured step with the per-param part of the check in compiled code (``--native``:
    what a C++ loop would cost, for comparison; not the package's)."""

    module: Any = None

    def still_valid(self, captured: Inputs) -> bool:
        if not captured.same_head(self.inputs(lists=False)):
            return False
        memo = getattr(self, "_memo", None)
        if memo is None or memo[0] is not captured:
            ptrs = [torch.tensor(a, dtype=torch.int64) for a in captured.addresses[::2]]
            memo = self._memo = (captured, ptrs)
        descr = DTensor.__dict__["_local_tensor"]
        i = 0
        for e in self.engines:
            plan = e.preparer.plan
            if plan is None:
                continue
            params, grads, grad_locals, locals_ = captured.lists[4 * i : 4 * i + 4]
            if params is not plan.params or not self.module.unmoved(
                params, grads, grad_locals, locals_, memo[1][i], descr
            ):
                return False
            i += 1
        return True


def _seam_of(pkg) -> Any:
    """The ``optim.seam`` of package ``pkg`` (mfsdp_optim or the ``--compare`` copy, which must
    be of a commit that has it)."""
    return importlib.import_module(f"{pkg.__name__}.optim.seam")


def _wrapper(pkg, cls, count: int, shape: tuple[int, ...], device, mesh) -> Any:
    """A wrapper of package ``pkg`` (mfsdp_optim or the ``--compare`` copy) whose captured
    step is ``cls``, captured and replayed twice."""
    FullyShardedOptimizer, OptimizerConfig = pkg.FullyShardedOptimizer, pkg.OptimizerConfig
    gen = torch.Generator(device=device).manual_seed(0)

    def dt(scale: float) -> DTensor:
        t = torch.randn(shape, device=device, generator=gen) * scale
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

    params = [torch.nn.Parameter(dt(1.0)) for _ in range(count)]
    for p in params:
        p.grad = dt(1e-3)
    w = FullyShardedOptimizer(
        torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True),
        OptimizerConfig(clip_grad=1.0, host_sync=False, cuda_graph=device.type == "cuda"),
    )
    # on CPU the wrapper refuses cuda_graph=True: the captured step with a runner that
    # replays nothing (the same glue the CPU tests use)
    if device.type != "cuda":
        w.config = OptimizerConfig(clip_grad=1.0, host_sync=False, cuda_graph=True)
    tools = _seam_of(pkg)
    tools.use_captured_step(w, cls, None if device.type == "cuda" else _NoLaunch())
    for _ in range(3):  # the warm-up and capture, then two replays
        w.step()
    g = tools.captured_step_of(w).graph
    if g.captures != 1 or g.replays != 2 or g.disabled:
        raise RuntimeError(f"{cls.__name__}: not replaying ({g.captures=}, {g.disabled=})")
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--counts", default="300,3000,30000")
    ap.add_argument("--shape", default="4x4")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--compare",
        default="",
        help="also time the whole step of another copy of the package (e.g. the previous main, "
        "renamed): 'module' or 'module=PATH'; its rows are 'prev'",
    )
    ap.add_argument(
        "--native",
        action="store_true",
        help="also time the per-param check compiled as C++ (torch.utils.cpp_extension: a "
        "compiler and ninja; an evaluation, not the package's code); its rows are 'native'",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: this thread's CPU time (time.thread_time), for a host shared with other "
        "work, where wall time counts the waits for a core",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        if device.index is None:  # set_device needs an index; "cuda" means the current one
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    shape = tuple(int(x) for x in args.shape.split("x"))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    helper = "C++" if seam.bulk_check_available() else "Python (no C++ helper)"
    print(
        f"device {device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), torch "
        f"{torch.__version__}, fused AdamW over N x {args.shape}, median of {args.iters} "
        f"({args.clock} clock); "
        f"address check: {helper}"
    )
    contenders: dict[str, tuple[Any, Any]] = {}
    if args.compare:
        from _compare import import_other

        prev = import_other(args.compare)
        contenders["prev"] = (prev, _seam_of(prev).CapturedStep)
    contenders["before"] = (mfsdp_optim, _Before)
    contenders["now"] = (mfsdp_optim, CapturedStep)
    if args.native:
        _Native.module = _native_module()
        contenders["native"] = (mfsdp_optim, _Native)
    base = "prev" if "prev" in contenders else "before"
    for count in (int(c) for c in args.counts.split(",")):
        wrappers = {
            name: _wrapper(pkg, cls, count, shape, device, mesh)
            for name, (pkg, cls) in contenders.items()
        }
        calls: dict[str, Any] = {}
        for name, w in wrappers.items():
            cs = _seam_of(contenders[name][0]).captured_step_of(w)
            calls[f"{name} step"] = w.step
            calls[f"{name} check"] = lambda cs=cs: cs.still_valid(cs.graph.inputs)
            if cuda:
                calls[f"{name} launch"] = cs.graph.runner.replay
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.iters):
            for key, fn in calls.items():
                sync()
                t0 = clock()
                ok = fn()
                times[key].append(clock() - t0)
                if key.endswith("check") and not ok:
                    raise RuntimeError(f"{key}: the capture no longer holds")
        sync()
        for name, w in wrappers.items():
            g = _seam_of(contenders[name][0]).captured_step_of(w).graph
            if g.captures != 1 or g.disabled:
                raise RuntimeError(f"{name}: captured again or disabled while timed")
        med = {k: statistics.median(v) for k, v in times.items()}
        for kind in ("step", "check", "launch"):
            if f"now {kind}" not in med:
                continue
            cells = ", ".join(
                f"{name} {med[f'{name} {kind}'] * 1e3:.3f} ms "
                f"({med[f'{name} {kind}'] / count * 1e9:.1f} ns/tensor)"
                for name in wrappers
            )
            ratios = ", ".join(
                f"{name}/{base} {med[f'{name} {kind}'] / med[f'{base} {kind}']:.2f}"
                for name in wrappers
                if name != base
            )
            print(f"N={count:>6} {kind:>6}: {cells} | {ratios}")
        fixed = ", ".join(
            f"{name} {(med[f'{name} step'] - med[f'{name} check']) * 1e3:.3f} ms"
            for name in wrappers
        )
        print(f"N={count:>6} step - check (the part flat in N): {fixed}")
        del wrappers, calls
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
