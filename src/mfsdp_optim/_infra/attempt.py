"""``Attempt``: one rank's way through a step of phases and collectives, raising on every rank
alike or on none.

A rank that raises between two collectives leaves its peers waiting in the next one. So a rank
keeps its first failure instead of raising (``run`` a phase, or ``fail``), skips the phases that
follow, and still enters every collective, sending ``status`` (1: it failed; what it sends is
then filler). It takes its peers' status words from each exchange (``heard``); once either side
failed, ``ok`` is False and ``run`` runs nothing more. After the last collective, before
anything is written, every rank settles alike:

- ``settle(group, wording)``, where status words went to every rank (so every rank knows
  alike whether any failed): nothing when none did; else ONE object gather of every rank's
  failure (``agreement.agree``), then the failing ranks raise their own error and the others
  ``RankFailedError`` naming them.
- ``verdict(group, ...)``, where no status word was exchanged: ``agreement.agree`` of this
  rank's ``failure`` (its one fixed-size all-reduce, the detail only when a rank failed), for
  the caller to raise as its protocol says (``raise_own_or_peer``, ``raise_one``).

Sketch (the whole-param step, ``optim/_whole/_generic.py``)::

    attempt = Attempt()
    records = attempt.run(pack, params, default=empty)
    got, statuses = exchange(records, attempt.status, group)
    attempt.heard(statuses)
    fulls = attempt.run(assemble, got, default={})  # skipped once any rank failed
    ...
    attempt.settle(group, WORDING)  # every rank raises alike, or returns
    write(...)                      # reached only when every rank succeeded
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from .agreement import Failure, Verdict, Wording, agree, failure_of

__all__ = ["Attempt"]

T = TypeVar("T")


class Attempt:
    """This rank's outcome so far in one rank-safe step.

    Args:
        error: A failure this rank already had when the step began (raised by ``settle``), or
            None.

    Attributes:
        error: This rank's own first failure (an exception, or a ``Failure`` carried over from
            elsewhere, e.g. a background thread's), or None.
        peer_failed: Some status word heard so far was non-zero.
    """

    def __init__(self, error: BaseException | Failure | None = None) -> None:
        self.error: BaseException | Failure | None = error
        self.peer_failed = False

    @property
    def ok(self) -> bool:
        """Neither this rank nor any peer heard from has failed: the next phase may run."""
        return self.error is None and not self.peer_failed

    @property
    def status(self) -> int:
        """The status word this rank sends in its next message: 1 when it failed, else 0 (a
        rank that only heard of a peer's failure sends 0: the peers know it from that peer)."""
        return int(self.error is not None)

    @property
    def exception(self) -> BaseException | None:
        """This rank's failure as it raises it: the exception itself, or a ``RuntimeError``
        with a carried ``Failure``'s text; None where this rank has not failed."""
        if self.error is None or isinstance(self.error, BaseException):
            return self.error
        return RuntimeError(self.error.text)

    @property
    def failure(self) -> Failure | None:
        """This rank's failure as ``agreement.agree`` takes it, or None."""
        return failure_of(self.error)

    def fail(self, error: BaseException | Failure) -> None:
        """Keep ``error`` as this rank's failure unless it already has one (the first is the
        cause; what follows it is often its consequence)."""
        if self.error is None:
            self.error = error

    def heard(self, statuses: Iterable[int]) -> None:
        """The status words an exchange brought (one per peer; 0 where none came)."""
        if any(statuses):
            self.peer_failed = True

    def run(self, phase: Callable[..., T], *args: Any, default: Any = None) -> T:
        """``phase(*args)`` while ``ok``; else ``default``, with nothing run. An ``Exception``
        it raises becomes this rank's failure (``fail``) and ``default`` is returned."""
        if not self.ok:
            return default
        try:
            return phase(*args)
        except Exception as exc:  # kept, so this rank still enters every collective
            self.fail(exc)
            return default

    def settle(self, group: dist.ProcessGroup | None, wording: Wording) -> None:
        """After the last collective, before anything is written, with every rank's status
        heard by every rank: return when no rank failed (no collective); else ONE object gather
        of every rank's failure, then raise: this rank's own error where it failed, otherwise
        ``RankFailedError`` naming the failing ranks and their errors."""
        if self.ok:
            return
        agree(self.error, group, always=True).raise_own_or_peer(self.exception, wording)
        raise RuntimeError(  # a status word without a failure behind it: a bug, never a result
            f"{wording.what}: a rank signalled a failure but reported none; nothing was updated"
        )

    def verdict(
        self,
        group: dist.ProcessGroup | None,
        *,
        digest: Sequence[int] = (),
        detail: Any = None,
    ) -> Verdict:
        """Every rank's outcome where no status word was exchanged: ``agreement.agree`` of
        ``failure`` (and ``digest``, ``detail``) over ``group``; raises nothing but a failed
        collective. The caller raises from the verdict as its protocol says."""
        return agree(self.failure, group, digest=digest, detail=detail)
