"""The rank-agreement protocol itself (``mfsdp_optim._infra.agreement``) on 4 real gloo ranks.

Both pieces: ``agree`` (its own fixed-size all-reduce, the detail only when needed) and
``VerdictSlots`` (the verdict riding in the caller's all-gather, next to a payload). The failing
rank catches nothing special: it raises its own error and returns normally, so a closed socket
can never be what frees the others; a hang fails the test through the pool's deadline. Every
case ends with one healthy agreement on every rank: the group is still in step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

BAD = 2  # the failing rank
WORLD = 4
DEADLINE_S = 60.0  # the pool's deadline: a rank left in a collective fails the test


def _wording():
    from mfsdp_optim._infra.agreement import Wording

    return Wording(
        what="the test step",
        where="test group",
        row="test row",
        call="call the test step",
        why="The result is one number",
    )


class _Count:
    """The real collectives one block issues (the real functions run, wrapped to count)."""

    def __enter__(self):
        from mfsdp_optim._infra import comm

        self.calls: list[tuple[str, int]] = []
        self._real = comm.all_gather_flat, dist.all_reduce

        def gather(out, inp, group):
            self.calls.append(("all_gather", inp.numel()))
            return self._real[0](out, inp, group)

        def reduce(tensor, *a, **k):
            self.calls.append(("all_reduce", tensor.numel()))
            return self._real[1](tensor, *a, **k)

        comm.all_gather_flat, dist.all_reduce = gather, reduce
        return self

    def __exit__(self, *exc):
        from mfsdp_optim._infra import comm

        comm.all_gather_flat, dist.all_reduce = self._real


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "failures", None))


def _healthy_again():
    from mfsdp_optim._infra.agreement import agree, digest

    return agree(None, None, digest=digest("again")).same


# ---------------------------------------------------------------------------------------------
# agree: alone


def _rank_agree(case):
    from mfsdp_optim._infra.agreement import agree, digest

    rank = dist.get_rank()
    own = KeyError("layers.7.weight") if case == "one_fails" and rank == BAD else None
    if case == "two_fail" and rank in (1, 3):
        own = ValueError(f"bad shard on rank {rank}")
    text = f"half {rank % 2}" if case == "digests_differ" else "same"

    def run():
        verdict = agree(own, None, digest=digest(text, "dir"), detail={"rank": rank})
        verdict.raise_own_or_peer(own, _wording())
        return verdict.same, verdict.details

    with _Count() as count:
        out = _outcome(run)
    return out, count.calls, _healthy_again()


def test_agree_all_ok_is_one_fixed_size_all_reduce(ranks):
    out = ranks(WORLD).run(_rank_agree, "ok", timeout=DEADLINE_S)
    for rank, (outcome, calls, again) in enumerate(out):
        assert outcome == ("ok", (True, None)), (rank, outcome)
        # [d, -d] of a 2-value digest: 4 int64, whatever the world size; nothing exchanged
        assert calls == [("all_reduce", 4)], (rank, calls)
        assert again


def test_agree_digests_differ_exchanges_every_detail(ranks):
    out = ranks(WORLD).run(_rank_agree, "digests_differ", timeout=DEADLINE_S)
    for rank, (outcome, calls, again) in enumerate(out):
        # nobody failed, so nothing raises; every rank holds every rank's detail, in rank order
        assert outcome == ("ok", (False, [{"rank": r} for r in range(WORLD)])), (rank, outcome)
        assert calls == [("all_reduce", 4), ("all_gather", 1), ("all_gather", calls[2][1])]
        assert again


def test_agree_one_rank_fails_and_stays_alive(ranks):
    out = ranks(WORLD).run(_rank_agree, "one_fails", timeout=DEADLINE_S)
    for rank, (outcome, calls, again) in enumerate(out):
        if rank == BAD:
            assert outcome == ("KeyError", "'layers.7.weight'", None), outcome
        else:
            name, msg, failures = outcome
            assert name == "RankFailedError", (rank, outcome)
            assert f"the test step failed on rank {BAD} of the 4-rank test group" in msg, msg
            assert "KeyError: 'layers.7.weight'" in msg and f"Fix the input on rank {BAD}" in msg
            assert failures == {BAD: "KeyError: 'layers.7.weight'"}
        # the same collectives on every rank: the all-reduce, then the detail (sizes, payload)
        assert [c[0] for c in calls] == ["all_reduce", "all_gather", "all_gather"], calls
        assert again, f"rank {rank}: the group is out of step after the failure"


def test_agree_two_failing_ranks_are_both_named(ranks):
    out = ranks(WORLD).run(_rank_agree, "two_fail", timeout=DEADLINE_S)
    for rank, (outcome, _, again) in enumerate(out):
        if rank in (1, 3):
            assert outcome == ("ValueError", f"bad shard on rank {rank}", None), outcome
        else:
            name, msg, failures = outcome
            assert name == "RankFailedError" and "failed on ranks [1, 3] of" in msg, outcome
            assert sorted(failures) == [1, 3]
        assert again


def _rank_raise_one():
    """The other verdict: every rank raises the same error, the first failing rank's class."""
    from mfsdp_optim._infra.agreement import agree

    rank = dist.get_rank()
    findings = [f"key {k!r} is missing" for k in ("a", "b")] if rank in (1, 2) else []
    if rank == 3:
        findings = ["key 'a' is missing"]

    def run():
        agree(findings, None).raise_one("refusing it", {"": LookupError})

    return _outcome(run), _healthy_again()


def test_agree_raise_one_lists_every_finding_once_with_its_ranks(ranks):
    out = ranks(WORLD).run(_rank_raise_one, timeout=DEADLINE_S)
    for rank, ((name, msg, _), again) in enumerate(out):
        assert name == "LookupError", (rank, name)
        assert (
            msg
            == "refusing it:\n  key 'a' is missing (ranks 1,2,3)\n  key 'b' is missing (ranks 1,2)"
        )
        assert again


# ---------------------------------------------------------------------------------------------
# VerdictSlots: riding in the caller's own all-gather


def _slots():
    from mfsdp_optim._infra.agreement import RankMismatchError, VerdictSlots

    return VerdictSlots(
        {"norm_type": float, "count_zeros": bool},
        magic=4242.0,
        wording=_wording(),
        mismatch=RankMismatchError,
    )


def _rank_slots(case):
    from mfsdp_optim._infra import comm

    rank, world, cpu = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    slots = _slots()
    failure = RuntimeError(f"int64 grad on rank {rank}") if case == "one_fails" else None
    if rank != BAD:
        failure = None
    norm_type = 1.0 if case == "mismatch" and rank == 3 else 2.0
    if case == "foreign" and rank == 0:
        slots = type(slots)({"a": float, "b": bool}, magic=7.0, wording=_wording())
    payload = torch.tensor([float(rank + 1)], dtype=torch.float64)
    mine = slots.encode(cpu, failure is not None, (norm_type, True))
    with _Count() as count:
        rows = torch.empty(world * (1 + slots.width), dtype=torch.float64)
        comm.all_gather_flat(rows, torch.cat([payload, mine]), None)  # the caller's collective
        rows = rows.view(world, 1 + slots.width)
        bad = bool(_slots().bad(rows[:, 1:], (norm_type, True)))  # the device-only verdict
        out = _outcome(lambda: _slots().settle(rows[:, 1:], failure, None, cpu) or rows[:, 0])
    if out[0] == "ok":
        out = ("ok", out[1].tolist())
    return out, bad, count.calls, _healthy_again()


def test_slots_all_ok_ride_in_one_collective(ranks):
    out = ranks(WORLD).run(_rank_slots, "ok", timeout=DEADLINE_S)
    for rank, (outcome, bad, calls, again) in enumerate(out):
        assert outcome == ("ok", [1.0, 2.0, 3.0, 4.0]), (rank, outcome)
        assert not bad and calls == [("all_gather", 5)], (rank, bad, calls)
        assert again


def test_slots_one_rank_fails_and_stays_alive(ranks):
    out = ranks(WORLD).run(_rank_slots, "one_fails", timeout=DEADLINE_S)
    for rank, (outcome, bad, calls, again) in enumerate(out):
        if rank == BAD:
            assert outcome == ("RuntimeError", f"int64 grad on rank {BAD}", None), outcome
        else:
            name, msg, failures = outcome
            assert name == "RankFailedError", (rank, outcome)
            assert f"failed on rank {BAD} of the 4-rank test group" in msg, msg
            assert failures == {BAD: f"RuntimeError: int64 grad on rank {BAD}"}
            assert bad, f"rank {rank}: the device verdict missed the failure"
        # the caller's collective, then ONE fixed-size message gather on every rank
        assert calls == [("all_gather", 5), ("all_gather", 2048)], (rank, calls)
        assert again


@pytest.mark.parametrize(
    "case, words",
    [
        ("mismatch", "passed different norm_type: 2.0 on ranks [0, 1, 2]; 1.0 on ranks [3]"),
        ("foreign", "ranks [0] of the test group sent something other than a test row"),
    ],
)
def test_slots_mismatch_raises_on_every_rank(ranks, case, words):
    out = ranks(WORLD).run(_rank_slots, case, timeout=DEADLINE_S)
    for rank, (outcome, bad, calls, again) in enumerate(out):
        name, msg, _ = outcome
        assert name == "RankMismatchError" and words in msg, (rank, outcome)
        assert bad and calls == [("all_gather", 5)], (rank, bad, calls)  # no second collective
        assert again


# ---------------------------------------------------------------------------------------------
# one process: no collective


def test_agree_without_a_process_group_is_this_rank_alone():
    from mfsdp_optim._infra.agreement import agree, by_rank, by_value, digest

    assert not dist.is_initialized()
    assert agree(None, digest=digest("x")).same
    verdict = agree(ValueError("no"), digest=digest("x"), detail=1)
    assert (verdict.same, verdict.details, verdict.failures[0].text) == (
        False,
        [1],
        "ValueError: no",
    )
    assert agree(["a finding"]).failures[0].lines == ("a finding",)
    assert by_rank([(0, "m"), (2, "m"), (1, "n")]) == ["m (ranks 0,2)", "n (rank 1)"]
    assert by_value([2.0, 2.0, float("inf"), 2.0]) == "2.0 on ranks [0, 1, 3]; inf on ranks [2]"
