"""``Attempt`` (``mfsdp_optim._infra.attempt``): keep a rank's failure, still enter every
collective, settle alike; on 4 real gloo ranks and in one process.

The failing rank catches nothing special: its phase raises, the attempt keeps the error, the
rank goes on through every exchange and raises its own error at ``settle``; a hang fails the
test through the pool's deadline. Every ranked case ends with one healthy agreement on every
rank: the group is still in step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

BAD = 2  # the failing rank
WORLD = 4
DEADLINE_S = 60.0  # the pool's deadline: a rank left in a collective fails the test

pytestmark = pytest.mark.timeout(180)


def _wording():
    from mfsdp_optim._infra.agreement import Wording

    return Wording(what="the test step", where="test group")


class _Count:
    """The real collectives one block issues, counted at ``torch.distributed`` (the real
    functions run, wrapped to count); an object gather is two flat all-gathers."""

    NAMES = {
        "all_reduce": "all_reduce",
        "all_gather": "all_gather",
        "all_gather_single": "all_gather_objects",
        "all_gather_into_tensor": "all_gather_objects",
    }

    def __enter__(self):
        self.calls: list[str] = []
        self._real = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

        def counted(name, real):
            def call(*args, **kwargs):
                self.calls.append(self.NAMES[name])
                return real(*args, **kwargs)

            return call

        for name, real in self._real.items():
            setattr(dist, name, counted(name, real))
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "failures", None))


def _healthy_again():
    from mfsdp_optim._infra.agreement import agree, digest

    return agree(None, None, digest=digest("again")).same


def _statuses(status: int) -> list[int]:
    """Every peer's status word (this rank's own left out, as the whole-param exchanges do)."""
    words = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(words, torch.tensor([status], dtype=torch.int64))
    me = dist.get_rank()
    return [int(w[0]) for r, w in enumerate(words) if r != me]


# ---------------------------------------------------------------------------------------------
# settle: after status words that reached every rank


def _rank_settle(failing: dict[int, str]):
    """Two phases, each followed by an exchange of status words, then ``settle`` and the write.
    ``failing``: rank -> the phase ("first" or "second") that raises there."""
    from mfsdp_optim._infra.attempt import Attempt

    rank = dist.get_rank()
    ran: list[str] = []
    written: list[str] = []

    def phase(name):
        ran.append(name)
        if failing.get(rank) == name:
            raise KeyError(f"layers.{rank}.weight")
        return name

    def step():
        attempt = Attempt()
        first = attempt.run(phase, "first", default="-")
        attempt.heard(_statuses(attempt.status))
        second = attempt.run(phase, "second", default="-")
        sent = attempt.status
        attempt.heard(_statuses(sent))
        attempt.settle(None, _wording())
        written.append(first + second)  # reached only when every rank succeeded
        return sent

    with _Count() as count:
        out = _outcome(step)
    return out, ran, written, count.calls, _healthy_again()


def test_settle_all_ok_issues_no_collective_of_its_own(ranks):
    out = ranks(WORLD).run(_rank_settle, {}, timeout=DEADLINE_S)
    for rank, (outcome, ran, written, calls, again) in enumerate(out):
        assert outcome == ("ok", 0), (rank, outcome)
        assert ran == ["first", "second"] and written == ["firstsecond"], (rank, ran, written)
        assert calls == ["all_gather", "all_gather"], (rank, calls)  # the caller's exchanges
        assert again


@pytest.mark.parametrize("where", ["first", "second"])
def test_settle_one_rank_fails_and_stays_alive(ranks, where):
    out = ranks(WORLD).run(_rank_settle, {BAD: where}, timeout=DEADLINE_S)
    for rank, (outcome, ran, written, calls, again) in enumerate(out):
        if rank == BAD:
            assert outcome == ("KeyError", f"'layers.{BAD}.weight'", None), outcome
        else:
            name, msg, failures = outcome
            assert name == "RankFailedError", (rank, outcome)
            assert f"the test step failed on rank {BAD} of the 4-rank test group" in msg, msg
            assert f"Fix the input on rank {BAD}" in msg, msg
            assert failures == {BAD: f"KeyError: 'layers.{BAD}.weight'"}
        # a failure in the first phase stops the second on every rank (heard in between)
        assert ran == (["first"] if where == "first" else ["first", "second"]), (rank, ran)
        assert written == [], (rank, written)
        # the same collectives on every rank: both exchanges, then ONE object gather (its
        # sizes, then its payload)
        assert calls == ["all_gather"] * 2 + ["all_gather_objects"] * 2, (rank, calls)
        assert again, f"rank {rank}: the group is out of step after the failure"


def test_settle_two_failing_ranks_are_both_named(ranks):
    out = ranks(WORLD).run(_rank_settle, {1: "second", 3: "second"}, timeout=DEADLINE_S)
    for rank, (outcome, ran, _, _, again) in enumerate(out):
        if rank in (1, 3):
            assert outcome == ("KeyError", f"'layers.{rank}.weight'", None), outcome
        else:
            name, msg, failures = outcome
            assert name == "RankFailedError" and "failed on ranks [1, 3] of" in msg, outcome
            assert sorted(failures) == [1, 3]
        assert ran == ["first", "second"], (rank, ran)
        assert again


def _rank_carried():
    """A ``Failure`` carried into the attempt (from a background thread, say) on rank BAD."""
    from mfsdp_optim._infra.agreement import Failure
    from mfsdp_optim._infra.attempt import Attempt

    carried = Failure("OSError", ("disk full",)) if dist.get_rank() == BAD else None
    attempt = Attempt(carried)
    attempt.heard(_statuses(attempt.status))
    return _outcome(lambda: attempt.settle(None, _wording())), _healthy_again()


def test_settle_a_carried_failure_raises_its_text_on_its_rank(ranks):
    out = ranks(WORLD).run(_rank_carried, timeout=DEADLINE_S)
    for rank, (outcome, again) in enumerate(out):
        if rank == BAD:
            assert outcome == ("RuntimeError", "OSError: disk full", None), outcome
        else:
            assert outcome[0] == "RankFailedError" and outcome[2] == {BAD: "OSError: disk full"}
        assert again


# ---------------------------------------------------------------------------------------------
# verdict: no status word exchanged


def _rank_verdict(fails: bool):
    from mfsdp_optim._infra.agreement import digest
    from mfsdp_optim._infra.attempt import Attempt

    rank = dist.get_rank()

    def check():
        if fails and rank == BAD:
            raise ValueError("no dir")

    attempt = Attempt()
    attempt.run(check)
    with _Count() as count:
        verdict = attempt.verdict(None, digest=digest("same"), detail=rank)
    return (verdict.same, {r: f.text for r, f in verdict.failures.items()}, verdict.details), (
        count.calls,
        _healthy_again(),
    )


def test_verdict_all_ok_is_one_all_reduce(ranks):
    out = ranks(WORLD).run(_rank_verdict, False, timeout=DEADLINE_S)
    for rank, (seen, (calls, again)) in enumerate(out):
        assert seen == (True, {}, None), (rank, seen)
        assert calls == ["all_reduce"] and again, (rank, calls)


def test_verdict_one_rank_fails_every_rank_learns_it(ranks):
    out = ranks(WORLD).run(_rank_verdict, True, timeout=DEADLINE_S)
    for rank, (seen, (calls, again)) in enumerate(out):
        assert seen == (False, {BAD: "ValueError: no dir"}, list(range(WORLD))), (rank, seen)
        assert calls == ["all_reduce"] + ["all_gather_objects"] * 2, (rank, calls)
        assert again


# ---------------------------------------------------------------------------------------------
# one process: the bookkeeping, and settle without a process group


def test_run_keeps_the_first_failure_and_skips_what_follows():
    from mfsdp_optim._infra.attempt import Attempt

    assert not dist.is_initialized()
    attempt = Attempt()
    assert attempt.ok and attempt.status == 0 and attempt.failure is None
    assert attempt.exception is None
    assert attempt.run(lambda a, b: a + b, 1, 2) == 3
    first = ValueError("first")

    def boom():
        raise first

    assert attempt.run(boom, default="filler") == "filler"
    assert not attempt.ok and attempt.status == 1 and attempt.error is first
    ran = []
    assert attempt.run(ran.append, 1, default={}) == {} and ran == []  # skipped
    attempt.fail(RuntimeError("consequence"))
    assert attempt.error is first and attempt.failure.text == "ValueError: first"
    assert attempt.exception is first
    with pytest.raises(ValueError, match="^first$"):
        attempt.settle(None, _wording())


def test_a_peer_failure_stops_the_phases_but_not_the_status():
    from mfsdp_optim._infra.attempt import Attempt

    attempt = Attempt()
    attempt.heard([0, 0])
    assert attempt.ok
    attempt.heard([0, 1, 0])
    attempt.heard([0, 0])  # a later exchange of healthy words does not clear it
    assert not attempt.ok and attempt.status == 0 and attempt.error is None
    assert attempt.run(lambda: 1, default=None) is None


def test_base_exceptions_are_not_kept():
    from mfsdp_optim._infra.attempt import Attempt

    attempt = Attempt()

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        attempt.run(interrupted)
    assert attempt.ok


def test_settle_without_a_failure_returns_and_with_an_error_from_the_start_raises_it():
    from mfsdp_optim._infra.attempt import Attempt

    Attempt().settle(None, _wording())
    given = TypeError("refused before the step")
    attempt = Attempt(given)
    assert attempt.run(lambda: 1) is None
    with pytest.raises(TypeError) as info:
        attempt.settle(None, _wording())
    assert info.value is given
