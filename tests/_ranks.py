"""Persistent pools of real gloo ranks for the test suite.

Spawning a fresh group of processes per test costs ~40 s on 2 cores; a hypothesis example per
spawn is out of the question. Instead each world size gets one pool of long-lived worker
processes, forked from a forkserver that has already imported torch, joined into one real gloo
process group. A test sends a module-level function (pickled by reference) and its arguments to
every rank and gets back each rank's return value, so a hypothesis example costs a few
milliseconds of queue traffic plus the real collectives.

Hangs become failures: every task has a deadline; when it passes (or a rank fails and the others
do not finish within a short grace), every live rank's thread stacks are dumped by faulthandler
(``_arm``: its watchdog thread at the task's deadline, SIGUSR1 on demand), the pool is torn down,
and the test fails with each rank's traceback. The next test gets a fresh pool, so one deadlock
never poisons the suite. A rank killed by a signal (a segfault in C++) leaves its story too:
faulthandler writes every thread's Python stack as the process dies, and the failure shows it.

``get_pool(n, cuda=False)`` is a pool whose ranks see no CUDA device, for code that must run on
CPU ranks on any machine (the docs' examples, a trainer's CPU mode): on a machine with a GPU,
``fully_shard`` without a mesh would otherwise put a gloo rank's params on CUDA.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from queue import Empty
from typing import Any

__all__ = [
    "RankPool",
    "RankFailure",
    "get_pool",
    "join_gloo_group",
    "shutdown_pools",
    "torchrun_env",
]

_PG_TIMEOUT_S = float(os.environ.get("MFSDP_TEST_PG_TIMEOUT", "60"))
_ERROR_GRACE_S = 10.0
_STORY_WAIT_S = (2.0, 10.0)  # for the watchdog's dump; then for the one SIGUSR1 asks for
_MAX_LIVE_RANKS = int(os.environ.get("MFSDP_TEST_MAX_LIVE_RANKS", "15"))
_READY_TIMEOUT_S = 180.0


class RankFailure(AssertionError):
    """A task failed or hung on at least one rank; the message holds every rank's story."""


def join_gloo_group(rank: int, world_size: int, init_file: str, timeout_s: float) -> None:
    """A spawned test rank's start: one CPU thread (``OMP_NUM_THREADS`` defaults to 1, set before
    torch is imported where it is not yet), then the gloo group through ``init_file``, whose
    collectives give up after ``timeout_s``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _arm(stacks, timeout: float) -> None:
    """A fresh story for the next ``timeout`` seconds: ``stacks`` emptied, faulthandler's
    watchdog thread set to dump every thread into it at the deadline (no signal involved: it
    cannot be lost), and SIGUSR1 (re-)registered to dump on demand (an earlier task may have
    replaced the handler; with the default one, SIGUSR1 would kill the rank before any dump).
    A fatal signal (SIGSEGV in C++, SIGABRT, ...) writes every thread's stack as the rank dies:
    faulthandler's handlers are (re-)installed too, since an earlier task's library may have
    replaced them (seen in CI: a segfault after the trainers' tests left no stack)."""
    stacks.seek(0)
    stacks.truncate()
    faulthandler.disable()  # enable() alone keeps handlers that another one has replaced since
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.dump_traceback_later(timeout, file=stacks)


@contextlib.contextmanager
def torchrun_env():
    """On a pool rank: the environment ``torchrun`` gives its workers (RANK, WORLD_SIZE, ...,
    TORCHELASTIC_RUN_ID) while the block runs, so a trainer that detects torchrun (Lightning,
    Fabric) joins the pool's process group, which is already up, instead of launching its own
    processes; the variables are restored afterwards."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    # a device mesh sets the CUDA device to LOCAL_RANK: where the pool has more ranks than the
    # machine has GPUs, they share them as DeviceMesh's own heuristic would (rank % count)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % gpus if gpus else rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "mfsdp-test-pool",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_main(rank, world_size, init_file, tasks, results, sys_path, stack_file, cuda):
    if not cuda:  # before anything in this process asks CUDA (the forkserver has not)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path[:] = sys_path
    # torch warns on every multi-dim full_tensor(); the tests call it on purpose
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    stacks = open(stack_file, "w")  # noqa: SIM115 - lives as long as the worker
    _arm(stacks, _READY_TIMEOUT_S)
    join_gloo_group(rank, world_size, init_file, _PG_TIMEOUT_S)
    faulthandler.cancel_dump_traceback_later()
    import torch.distributed as dist

    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, timeout = task
        _arm(stacks, timeout)
        try:
            value = fn(*args, **kwargs)
            # pickle here, where a failure can still be reported (the queue's feeder thread
            # would only print it, and the test would wait for a result that never comes)
            payload = pickle.dumps(value)
            results.put((rank, "ok", payload))
        except BaseException:  # report everything, including assertion errors
            results.put((rank, "error", traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` live gloo ranks that run the same function together."""

    def __init__(self, world_size: int, cuda: bool = True):
        self.world_size = world_size
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
        self._dir = tempfile.mkdtemp(prefix=f"mfsdp_ranks{world_size}_")
        init_file = os.path.join(self._dir, "init")
        self._stack_files = [os.path.join(self._dir, f"stacks{r}.txt") for r in range(world_size)]
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(
                    r,
                    world_size,
                    init_file,
                    self._tasks[r],
                    self._results,
                    list(sys.path),
                    self._stack_files[r],
                    cuda,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect("ready", timeout=_READY_TIMEOUT_S)
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any):
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self.alive:
            raise RuntimeError("this rank pool was shut down")
        for queue in self._tasks:
            queue.put((fn, args, kwargs, timeout))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = self._results.get(timeout=min(remaining, 1.0))
            except Empty:  # queue.Empty: check for dead workers and keep waiting
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                errors.update(
                    {r: self._death(r) for r in dead if r not in values and r not in errors}
                )
                continue
            if status == "error":
                errors[rank] = value
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            elif status == "ok":
                values[rank] = pickle.loads(value)
            else:
                values[rank] = value
        if not errors and len(values) == self.world_size:
            return [values[r] for r in range(self.world_size)]
        missing = [r for r in range(self.world_size) if r not in values and r not in errors]
        # a rank that raised cut the deadline short: the others' watchdogs have not fired
        stacks = self._dump_stacks(missing, watchdog_fired=not errors)
        if missing or not all(p.is_alive() for p in self._procs):
            # a rank is stuck (in a collective, probably) or gone: this pool is unusable
            self.shutdown()
        lines = [f"{what} failed on {self.world_size} ranks"]
        for r in range(self.world_size):
            if r in errors:
                lines.append(f"--- rank {r}: raised\n{errors[r]}")
            elif r in missing:
                lines.append(f"--- rank {r}: did not finish (hang?); its threads:\n{stacks[r]}")
            else:
                lines.append(f"--- rank {r}: ok")
        raise RankFailure("\n".join(lines))

    def _death(self, r: int) -> str:
        """A dead rank's story: its exit code (a negative one names the signal) and the stacks
        faulthandler wrote as a fatal signal killed it."""
        code = self._procs[r].exitcode
        what = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                what += f", {signal.Signals(-code).name}"
        story = _story(self._stack_files[r])
        return f"process died ({what})" + (f"; its threads as it died:\n{story}" if story else "")

    def _dump_stacks(self, ranks: list[int], watchdog_fired: bool) -> dict[int, str]:
        """Each of ``ranks``' thread stacks: the dump its watchdog wrote at the task's deadline
        (``watchdog_fired``: the deadline was reached), or else the one SIGUSR1 asks for (the
        error grace cut the deadline short, or the watchdog's dump did not come); waited for,
        not assumed after a fixed sleep."""
        files = {r: self._stack_files[r] for r in ranks if self._procs[r].is_alive()}
        wait = _STORY_WAIT_S[0] if watchdog_fired else 0.0
        if not _wait_for_stories(files.values(), wait):
            for r in files:
                pid = self._procs[r].pid
                if not _story(files[r]) and pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
            _wait_for_stories(files.values(), _STORY_WAIT_S[1])
        return {r: _story(self._stack_files[r]) or self._no_story(r) for r in ranks}

    def _no_story(self, r: int) -> str:
        """What is known of a rank that wrote no stacks: alive or its exit code, and the
        kernel's view of its threads (name and wait channel, where /proc has them)."""
        proc = self._procs[r]
        state = "alive" if proc.is_alive() else f"exited, code {proc.exitcode}"
        lines = [f"(no Python stacks within {sum(_STORY_WAIT_S):.0f} s; the rank is {state})"]
        task_dir = f"/proc/{proc.pid}/task"
        with contextlib.suppress(OSError):
            for tid in sorted(os.listdir(task_dir), key=int):
                fields = []
                for name in ("comm", "wchan"):
                    with contextlib.suppress(OSError), open(f"{task_dir}/{tid}/{name}") as f:
                        fields.append(f.read().strip())
                lines.append(f"  thread {tid}: " + " in ".join(fields))
        return "\n".join(lines)

    def shutdown(self) -> None:
        if not getattr(self, "alive", True):
            return
        self.alive = False
        for proc, queue in zip(self._procs, self._tasks, strict=True):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    queue.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _story(path: str) -> str:
    """The stacks dumped into ``path`` during the current task ("" when none, yet)."""
    try:
        with open(path) as f:
            return f.read()[-8000:]
    except OSError:
        return ""


def _wait_for_stories(paths: Iterable[str], timeout: float) -> bool:
    """Wait until every file of ``paths`` holds a dump that stopped growing (two polls 50 ms
    apart with the same size); False when ``timeout`` passed first."""
    paths = list(paths)
    deadline = time.monotonic() + timeout
    last: dict[str, int] = {}
    while True:
        sizes = {}
        for p in paths:
            with contextlib.suppress(OSError):
                sizes[p] = os.path.getsize(p)
        if all(sizes.get(p, 0) > 0 and sizes[p] == last.get(p) for p in paths):
            return True
        if time.monotonic() >= deadline:
            return False
        last = sizes
        time.sleep(0.05)


_POOLS: dict[tuple[int, bool], RankPool] = {}


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def get_pool(world_size: int, cuda: bool = True) -> RankPool:
    """The live pool for ``world_size``, starting one (and retiring the least recently used pools
    while more than ``MFSDP_TEST_MAX_LIVE_RANKS`` ranks would be alive). ``cuda=False``: ranks
    that see no CUDA device (on a machine without one, the same pool as ``cuda=True``)."""
    key = (world_size, cuda or not _cuda_here())
    pool = _POOLS.pop(key, None)
    if pool is None or not pool.alive:
        live = sum(p.world_size for p in _POOLS.values())
        for other in list(_POOLS):
            if live + world_size <= _MAX_LIVE_RANKS:
                break
            live -= other[0]
            _POOLS.pop(other).shutdown()
        pool = RankPool(world_size, cuda=key[1])
    _POOLS[key] = pool  # most recently used last
    return pool


def shutdown_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].shutdown()
