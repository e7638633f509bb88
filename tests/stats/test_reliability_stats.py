"""The stats path's rank agreement on real gloo ranks: one careless rank never hangs the group.

Each case runs on 4 ranks. The failing rank (rank 2 unless said otherwise) catches its own error
and returns normally, as a real job that logs it would, so "the peer died and its socket
closed" can never be what frees the others; the healthy ranks must raise within a few seconds,
naming the failing rank and its error. Every case then runs one healthy ``grad_stats`` call on
every rank and checks its value: the ranks are still in step (same collectives, same order).
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

BAD = 2  # the careless rank
FAST_S = 5.0  # healthy ranks must raise within this


def _mesh():
    from _layouts import get_mesh

    return get_mesh((dist.get_world_size(),))


def _dt(local, mesh=None):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh or _mesh(), (Shard(0),), run_check=False)


def _good():
    return [_dt(torch.full((3,), 2.0))]


def _raising_iterable():
    yield _dt(torch.ones(3))
    raise KeyError("grads generator ran out of params ('layers.7.weight' was deleted)")


def _call(kind, rank):
    """Issue the call of case ``kind`` as rank ``rank`` would; returns the GradStats."""
    from mfsdp_optim import stats
    from mfsdp_optim.stats import _reduce
    from mfsdp_optim.stats._buckets import bucket_local_shards

    bad = rank == BAD
    if kind == "norm_type_0":
        return stats.grad_stats(_good(), norm_type=0 if bad else 2.0)
    if kind == "norm_type_str":
        return stats.grad_stats(_good(), norm_type="l2" if bad else 2.0)
    if kind == "int64_grad":
        return stats.grad_stats([_dt(torch.ones(3, dtype=torch.int64))] if bad else _good())
    if kind == "complex_grad":
        return stats.grad_stats([_dt(torch.ones(3, dtype=torch.complex64))] if bad else _good())
    if kind == "meta_grad":
        return stats.grad_stats([_dt(torch.empty(3, device="meta"))] if bad else _good())
    if kind == "raising_iterable":
        return stats.grad_stats(_raising_iterable() if bad else _good())
    if kind == "plain_tensor":
        return stats.grad_stats([torch.ones(3)] if bad else _good())
    if kind == "count_zeros_str":
        return stats.grad_stats(_good(), count_zeros="yes" if bad else False)
    if kind == "wrapper_error":  # what the wrapper passes: its own prepare loop's exception
        buckets = (
            AttributeError(
                "'Tensor' object has no attribute '_local_tensor' "
                "(param 'w': a plain-tensor .grad on a DTensor param)"
            )
            if bad
            else bucket_local_shards(_good(), None)
        )
        kw = dict(norm_type=2.0, count_zeros=False, group=None)
        return _reduce.reduce_grads(buckets, **kw).seg.stats
    if kind == "two_fail":  # ranks 1 and 2 fail differently
        if rank == 1:
            return stats.grad_stats([torch.ones(3)])
        return stats.grad_stats(_good(), norm_type=0 if bad else 2.0)
    if kind == "all_fail":
        return stats.grad_stats(_good(), norm_type=-1.0)
    if kind == "norm_type_differs":
        return stats.grad_stats(_good(), norm_type=1.0 if bad else 2.0)
    if kind == "norm_type_inf_on_one":  # once an all-gather on one rank, all-reduce on others
        return stats.grad_stats(_good(), norm_type=math.inf if bad else 2.0)
    if kind == "count_zeros_differs":
        return stats.grad_stats(_good(), count_zeros=bad)
    if kind == "get_grad_norm_vs_count_zeros":
        return stats.count_zeros(_good()) if bad else stats.get_grad_norm(_good())
    raise AssertionError(kind)


def _rank_case(kind):
    rank = dist.get_rank()
    t0 = time.monotonic()
    try:
        _call(kind, rank)
    except Exception as exc:  # the failing rank stays alive: caught and "logged"
        outcome = (
            type(exc).__name__,
            str(exc),
            time.monotonic() - t0,
            getattr(exc, "failures", None),
        )
    else:
        outcome = None
    # still in step: a healthy call on every rank gives the right global norm
    from mfsdp_optim import stats

    after = float(stats.get_grad_norm(_good()))
    return outcome, after


# kind: (failing ranks, their exception and words, the healthy ranks' exception and words)
FAILS = {
    "norm_type_0": ("ValueError", "norm_type must be > 0", "norm_type must be > 0"),
    "norm_type_str": ("TypeError", "norm_type must be a number", "norm_type must be a number"),
    "int64_grad": ("RuntimeError", "", "RuntimeError"),
    "complex_grad": (None, "", ""),  # whatever torch raises, named on the others
    "meta_grad": (None, "", ""),
    "raising_iterable": ("KeyError", "layers.7.weight", "KeyError"),
    "plain_tensor": ("TypeError", "expected a DTensor", "expected a DTensor"),
    "count_zeros_str": ("TypeError", "count_zeros must be True or False", "count_zeros must be"),
    "wrapper_error": ("AttributeError", "plain-tensor .grad", "AttributeError"),
}


def _norm_ok(after, world=4):
    return after == pytest.approx(math.sqrt(4.0 * 3 * world))


@pytest.mark.parametrize("kind", sorted(FAILS))
def test_one_failing_rank_makes_every_rank_raise_promptly(ranks, kind):
    out = ranks(4).run(_rank_case, kind, timeout=60)
    cls, words, peer_words = FAILS[kind]
    bad_outcome = out[BAD][0]
    assert bad_outcome is not None, "the failing rank returned a value"
    if cls is not None:
        assert bad_outcome[0] == cls and words in bad_outcome[1], bad_outcome
    for rank, (outcome, after) in enumerate(out):
        assert _norm_ok(after), f"rank {rank} out of step afterwards: {after}"
        if rank == BAD:
            continue
        assert outcome is not None, f"healthy rank {rank} returned a value"
        name, msg, elapsed, failures = outcome
        assert name == "RankFailedError", (rank, outcome)
        assert f"failed on rank {BAD} " in msg and peer_words in msg, msg
        assert f"{bad_outcome[0]}: " in msg and bad_outcome[1][:60] in msg, (msg, bad_outcome)
        assert "Fix the input on rank 2" in msg
        assert list(failures) == [BAD]
        assert elapsed < FAST_S, f"rank {rank} took {elapsed:.1f}s to raise"


def test_two_failing_ranks_are_both_named(ranks):
    out = ranks(4).run(_rank_case, "two_fail", timeout=60)
    assert out[1][0][0] == "TypeError" and out[2][0][0] == "ValueError"
    for rank in (0, 3):
        name, msg, elapsed, failures = out[rank][0]
        assert name == "RankFailedError" and "ranks [1, 2]" in msg, msg
        assert "rank 1: TypeError" in msg and "rank 2: ValueError: norm_type" in msg, msg
        assert sorted(failures) == [1, 2] and elapsed < FAST_S
    assert all(_norm_ok(after) for _, after in out)


def test_every_rank_failing_raises_its_own_error(ranks):
    out = ranks(4).run(_rank_case, "all_fail", timeout=60)
    for outcome, after in out:
        assert outcome[0] == "ValueError" and "norm_type must be > 0" in outcome[1]
        assert outcome[2] < FAST_S and _norm_ok(after)


MISMATCH = {
    "norm_type_differs": "different norm_type: 2.0 on ranks [0, 1, 3]; 1.0 on ranks [2]",
    "norm_type_inf_on_one": "different norm_type: 2.0 on ranks [0, 1, 3]; inf on ranks [2]",
    "count_zeros_differs": "different count_zeros: False on ranks [0, 1, 3]; True on ranks [2]",
    "get_grad_norm_vs_count_zeros": "different count_zeros",
}


@pytest.mark.parametrize("kind", sorted(MISMATCH))
def test_arguments_that_differ_between_ranks_raise_everywhere(ranks, kind):
    out = ranks(4).run(_rank_case, kind, timeout=60)
    for rank, (outcome, after) in enumerate(out):
        assert outcome is not None, f"rank {rank} returned a value"
        name, msg, elapsed, _ = outcome
        assert name == "StatsArgumentMismatchError" and MISMATCH[kind] in msg, (rank, msg)
        assert "every rank must pass the same" in msg
        assert elapsed < FAST_S and _norm_ok(after)


def _rank_count_collectives(kind):
    """Count the real collectives one call issues (the real functions, wrapped to count)."""
    from mfsdp_optim import stats
    from mfsdp_optim._infra import comm

    calls = []
    raised = None
    real_gather, real_reduce = comm.all_gather_flat, dist.all_reduce

    def gather(out, inp, group):
        calls.append(("all_gather", inp.numel()))
        return real_gather(out, inp, group)

    def reduce(*a, **k):
        calls.append(("all_reduce", a[0].numel()))
        return real_reduce(*a, **k)

    comm.all_gather_flat, dist.all_reduce = gather, reduce
    try:
        if kind == "healthy":
            stats.grad_stats(_good(), norm_type=2.0, count_zeros=True)
        elif kind == "healthy_inf":
            stats.grad_stats(_good(), norm_type=math.inf)
        else:
            stats.grad_stats(_good(), norm_type=0 if dist.get_rank() == BAD else 2.0)
    except (ValueError, stats.RankFailedError) as exc:  # the "fail" case: asserted by the test
        raised = (type(exc).__name__, str(exc))
    finally:
        comm.all_gather_flat, dist.all_reduce = real_gather, real_reduce
    return calls, raised


def test_one_collective_when_healthy_two_when_a_rank_failed(ranks):
    pool = ranks(4)
    for kind in ("healthy", "healthy_inf"):
        assert pool.run(_rank_count_collectives, kind) == [([("all_gather", 12)], None)] * 4, kind
    out = pool.run(_rank_count_collectives, "fail")
    assert [calls for calls, _ in out] == [[("all_gather", 12), ("all_gather", 2048)]] * 4
    # the failing rank raises its own error; every healthy one names it
    name, msg = out[BAD][1]
    assert name == "ValueError" and "norm_type must be > 0" in msg, out[BAD]
    for rank in (0, 1, 3):
        name, msg = out[rank][1]
        assert name == "RankFailedError" and f"failed on rank {BAD} " in msg, (rank, msg)
        assert "ValueError: norm_type must be > 0" in msg, (rank, msg)


def _rank_device_only():
    """read="device": the failing rank raises at once; the others get NaN and found_inf."""
    from mfsdp_optim.stats import _reduce
    from mfsdp_optim.stats._buckets import bucket_local_shards

    rank = dist.get_rank()
    buckets = RuntimeError("boom") if rank == BAD else bucket_local_shards(_good(), None)
    try:
        st = _reduce.reduce_grads(
            buckets, read="device", norm_type=2.0, count_zeros=False, group=None
        ).seg.stats
    except RuntimeError as exc:
        res = ("raised", str(exc))
    else:
        res = ("ok", math.isnan(float(st.total_norm)), bool(st.found_inf))
    mismatch = _reduce.reduce_grads(
        bucket_local_shards(_good(), None),
        read="device",
        norm_type=1.0 if rank == BAD else 2.0,
        count_zeros=False,
        group=None,
    ).seg.stats
    return res, (math.isnan(float(mismatch.total_norm)), bool(mismatch.found_inf))


def test_device_only_mode_poisons_the_result_instead(ranks):
    out = ranks(4).run(_rank_device_only, timeout=60)
    assert out[BAD][0] == ("raised", "boom")
    for rank in (0, 1, 3):
        assert out[rank][0] == ("ok", True, True), out[rank]
    assert all(o[1] == (True, True) for o in out)


def _rank_agreed(kind):
    """The row's agreed values (the wrapper's hyperparameter digests): rank BAD passes other
    values than the others. Read on the host: ``AgreedValuesError`` on every rank, each rank's
    values in it, nothing returned; on the device: NaN statistics, ``found_inf`` and ``bad``;
    the deferred verdict: ``bad`` on the device, the error from ``verdict()``. Then a healthy
    call: the group is still in step."""
    from mfsdp_optim.stats import _reduce
    from mfsdp_optim.stats._buckets import bucket_local_shards

    rank = dist.get_rank()
    mine = [1.0, 2.0, 3.0 + (0.5 if rank == BAD else 0.0)]
    agreed = torch.tensor(mine, dtype=torch.float64)
    kw = dict(segments=1, norm_type=2.0, count_zeros=False, group=None, agreed=agreed)
    buckets = bucket_local_shards(_good(), None)
    t0 = time.monotonic()
    out: tuple = ()
    try:
        if kind == "read":
            _reduce.reduce_grads(buckets, read="host", **kw)
        elif kind == "device":
            seg = _reduce.reduce_grads(buckets, read="device", **kw).seg
            assert seg.bad is not None
            out = (
                math.isnan(float(seg.stats.total_norm)),
                bool(seg.stats.found_inf),
                bool(seg.bad),
            )
        else:
            deferred = _reduce.reduce_grads(buckets, read="deferred", **kw).deferred
            assert deferred is not None
            bad, verdict = deferred
            out = (bool(bad),)
            verdict()
        raised = None
    except _reduce.AgreedValuesError as exc:
        raised = (str(exc), exc.ranks)
    elapsed = time.monotonic() - t0
    after = _reduce.reduce_grads(
        buckets, read="host", **{**kw, "agreed": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    ).host
    return out, raised, elapsed, after


@pytest.mark.parametrize("kind", ["read", "device", "deferred"])
def test_agreed_values_that_differ_are_caught_on_every_rank(ranks, kind):
    out = ranks(4).run(_rank_agreed, kind, timeout=60)
    want = [(1.0, 2.0, 3.5 if r == BAD else 3.0) for r in range(4)]
    for rank, (values, raised, elapsed, after) in enumerate(out):
        assert elapsed < FAST_S, (rank, elapsed)
        assert after[0] == 0.0 and after[1] == pytest.approx(2.0 * 12**0.5), after  # in step
        if kind == "device":
            assert values == (True, True, True) and raised is None, (rank, values, raised)
            continue
        assert raised is not None, f"rank {rank}: agreed values that differ were accepted"
        message, ranks_values = raised
        assert ranks_values == want, ranks_values
        assert "agreed values of the 4-rank grad-stats group differ" in message, message
        if kind == "deferred":
            assert values == (True,), values


def _rank_keepalive():
    """What a captured step holds (``capture_keepalive``) against the caches it stands for, read
    directly: the same objects, cache by cache, in the same order."""
    from mfsdp_optim import stats
    from mfsdp_optim.stats import _fused, _reduce
    from mfsdp_optim.stats.seam import capture_keepalive

    stats.grad_stats(_good())
    stats.grad_stats(_good(), count_zeros=True)  # other verdict slots
    got = capture_keepalive()
    want = [
        list(_fused._table_cache.values()),
        list(_fused._workspaces.values()),
        list(_reduce._SLOTS._cache.values()),
        list(_reduce._CONSTANTS.values()),
    ]
    same = len(got) == len(want) and all(
        len(g) == len(w) and all(a is b for a, b in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    )
    return same, [len(w) for w in want]


def test_capture_keepalive_holds_the_caches_of_the_stats_layer(ranks):
    [(same, sizes)] = ranks(1).run(_rank_keepalive)
    assert sizes[2] >= 2 and sizes[3] >= 1, sizes  # something to hold (CPU: no kernel tables)
    assert same
