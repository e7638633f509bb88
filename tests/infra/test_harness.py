"""The rank pool itself: a deadlock becomes a failure that shows every rank's stack, and the
suite carries on with a fresh pool."""

from __future__ import annotations

import time

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


def _rank_raise_on_one(bad):
    if dist.get_rank() == bad:
        raise RuntimeError(f"planted failure on rank {bad}")
    return "fine"


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
