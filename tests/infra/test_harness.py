"""The rank pool itself: a deadlock becomes a failure that shows every rank's stack, and the
suite carries on with a fresh pool. The stuck rank's stack comes from faulthandler's watchdog at
the task's deadline (no signal), or from SIGUSR1 when a rank that raised cut the deadline short;
a task that replaced the SIGUSR1 handler loses neither."""

from __future__ import annotations

import os
import signal
import time

import _ranks
import pytest
import torch
import torch.distributed as dist
from _ranks import RankFailure


def _rank_mismatched_collective():
    # rank 0 waits in an all_reduce that no other rank issues: a real deadlock
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _rank_identity():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _rank_hang_without_the_signal_handler():
    # SIGUSR1 back to its default action, which ends the process: a story that needs the
    # signal would come back empty, the rank killed
    if dist.get_rank() == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    return _rank_mismatched_collective()


def _rank_raise_or_hang():
    if dist.get_rank() == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins


def _rank_raise_on_one(bad):
    if dist.get_rank() == bad:
        raise RuntimeError(f"planted failure on rank {bad}")
    return "fine"


def _rank_segfault_on_one(bad):
    if dist.get_rank() == bad:
        _die_by_signal(os.getpid())
    return "fine"


def _die_by_signal(pid):
    os.kill(pid, signal.SIGSEGV)  # as a crash in C++ would: faulthandler's handler, then death
    time.sleep(30)  # not reached


def _rank_device_facts():
    return torch.cuda.is_available(), torch._C._get_accelerator().type


def test_a_rank_killed_by_a_signal_leaves_its_stack(ranks):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        ranks(2).run(_rank_segfault_on_one, 1, timeout=60)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 1: raised" in message and "exit code -11, SIGSEGV" in message, message
    # faulthandler's dump as the rank died: the signal and the Python frames that raised it
    assert "Segmentation fault" in message and "_die_by_signal" in message, message
    assert "_rank_segfault_on_one" in message, message
    assert "rank 0: ok" in message, message
    assert ranks(2).run(_rank_identity) == [(0, 2), (1, 2)]  # a fresh pool


def test_a_cpu_pool_sees_no_cuda_device(ranks):
    # what fully_shard without a mesh reads: on a GPU machine the default pool says cuda
    assert ranks(2, cuda=False).run(_rank_device_facts) == [(False, "cpu")] * 2
    assert ranks(2, cuda=False).run(_rank_identity) == [(0, 2), (1, 2)]


def test_a_hang_fails_fast_with_every_rank_story(ranks):
    pool = ranks(2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_rank_mismatched_collective, timeout=5)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 0: did not finish" in message
    assert "all_reduce" in message  # faulthandler's stack of the stuck rank
    assert "rank 1: ok" in message
    # the broken pool was retired; the next request gets a working one
    assert ranks(2).run(_rank_identity) == [(0, 2), (1, 2)]


def test_a_raising_rank_is_reported_and_the_pool_survives(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure, match="planted failure on rank 1"):
        pool.run(_rank_raise_on_one, 1)
    assert pool.alive
    assert pool.run(_rank_identity) == [(0, 2), (1, 2)]


def test_the_story_does_not_need_the_signal_handler(ranks):
    with pytest.raises(RankFailure) as info:
        ranks(2).run(_rank_hang_without_the_signal_handler, timeout=5)
    message = str(info.value)
    assert "rank 0: did not finish" in message and "all_reduce" in message, message
    # the next task re-registers the handler: a fresh pool, the same story
    with pytest.raises(RankFailure, match="all_reduce"):
        ranks(2).run(_rank_mismatched_collective, timeout=5)


def test_a_rank_that_raised_cuts_the_wait_and_the_others_stories_come_by_signal(ranks, monkeypatch):
    monkeypatch.setattr(_ranks, "_ERROR_GRACE_S", 2.0)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        ranks(2).run(_rank_raise_or_hang, timeout=120)  # its watchdog is far away
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 1: raised" in message and "planted failure on rank 1" in message, message
    assert "rank 0: did not finish" in message and "all_reduce" in message, message
