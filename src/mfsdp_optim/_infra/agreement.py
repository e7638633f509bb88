"""One rank-agreement protocol: every rank validates, then all agree, then the collective.

Map: ``agree`` settles it alone: ONE fixed-size ``all_reduce`` (failure flag, digest), then ONE
object gather of every rank's failure and detail only when a rank failed or digests differ.
``VerdictSlots`` instead rides in a caller's own all-gather: ``encode`` this rank's slots,
``bad`` on the device, ``settle`` on the host (a message gather only when a rank failed). Every
rank reaches the same ``Verdict`` and raises alike: its own error and ``RankFailedError`` on the
others (``raise_own_or_peer``), or one error everywhere (``raise_one``). ``by_rank`` and
``by_value`` are the one message formatter; ``digest`` hashes what must match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import caches, comm

__all__ = [
    "Failure",
    "RankFailedError",
    "RankMismatchError",
    "Verdict",
    "VerdictSlots",
    "Wording",
    "agree",
    "by_rank",
    "by_value",
    "digest",
    "failure_of",
    "gather_messages",
    "peer_failure",
]

_MESSAGE_BYTES = 2048  # per rank, on the failure path of VerdictSlots only
_SLOTS_CACHE_SIZE = 64


class RankFailedError(RuntimeError):
    """Raised on the healthy ranks of a group when another rank's input was refused.

    The failing rank itself raises its own exception; nobody gets a result.

    Args:
        message: The error message (it names the failing ranks and their errors).
        failures: Each failing rank (its rank in the group) mapped to ``"ExcType: message"``.

    Attributes:
        failures: Each failing rank (its rank in the group) mapped to ``"ExcType: message"``.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


class RankMismatchError(ValueError):
    """Ranks of a group passed values that must be equal on every rank (raised on every rank).

    The base of ``StatsArgumentMismatchError``, ``HyperparameterMismatchError`` and
    ``RankDisagreementError``; raised as itself where ranks' whole-param plans differ."""


class Wording(NamedTuple):
    """The nouns of the protocol's messages at one call site."""

    what: str  # what failed: "grad statistics"
    where: str  # the group: "grad-stats group"
    row: str = ""  # VerdictSlots: what a row is ("grad-stats row")
    call: str = ""  # VerdictSlots: what every rank must call ("call the stats functions")
    why: str = ""  # VerdictSlots: why the arguments must match ("The statistic is one ...")


class Failure(NamedTuple):
    """One rank's refusal: its exception's class name (``""`` for findings) and its lines."""

    kind: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        body = "\n  ".join(self.lines)
        return f"{self.kind}: {body}" if self.kind else body


def failure_of(outcome: BaseException | Failure | Sequence[str] | None) -> Failure | None:
    """This rank's outcome as a ``Failure``: None (ok), an exception, or findings (lines; none
    found is ok)."""
    if outcome is None or isinstance(outcome, Failure):
        return outcome
    if isinstance(outcome, BaseException):
        return Failure(type(outcome).__name__, (str(outcome),))
    lines = (outcome,) if isinstance(outcome, str) else tuple(outcome)
    return Failure("", lines) if lines else None


def by_rank(pairs: Iterable[tuple[int, str]]) -> list[str]:
    """Each distinct message once, in first-seen order, with the ranks that reported it:
    ``"msg (rank 2)"``, ``"msg (ranks 0,3)"``."""
    ranks_of: dict[str, list[int]] = {}
    for rank, message in pairs:
        ranks_of.setdefault(message, []).append(rank)
    return [
        f"{m} (rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))})"
        for m, rs in ranks_of.items()
    ]


def by_value(values: Sequence[Any], limit: int | None = None) -> str:
    """Each distinct value once (its repr), with the ranks that passed it (index = rank):
    ``"2.0 on ranks [0, 1, 3]; inf on ranks [2]"``; the first ``limit`` values only."""
    ranks_of: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(value, []).append(rank)
    return "; ".join(f"{v!r} on ranks {rs}" for v, rs in list(ranks_of.items())[:limit])


def digest(*parts: str) -> list[int]:
    """One non-negative 62-bit hash per part: equal on two ranks iff (up to hash collisions)
    the parts are equal."""
    out = []
    for part in parts:
        h = hashlib.blake2b(part.encode(), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 2)
    return out


def peer_failure(failures: Mapping[int, str], world: int, wording: Wording) -> RankFailedError:
    """The error of a healthy rank: ``failures`` maps each failing rank to its error text."""
    named = {r: m or "(no message)" for r, m in failures.items()}
    failed = list(named)
    lines = "\n  ".join(f"rank {r}: {m}" for r, m in named.items())
    which = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    return RankFailedError(
        f"{wording.what} failed on {which} of the {world}-rank {wording.where}, so no rank "
        f"gets a result (this rank's own input was fine):\n  {lines}\n"
        f"Fix the input on {which}; the traceback there shows where it came from.",
        named,
    )


class Verdict(NamedTuple):
    """What every rank of the group learned, the same on every rank.

    failures: each failing rank (group rank, ascending) and its ``Failure``.
    same: no rank failed and every rank passed the same digest (nothing was exchanged).
    details: every rank's detail, in group-rank order, when exchanged; else None.
    world: the group's size.
    """

    failures: dict[int, Failure]
    same: bool
    details: list[Any] | None
    world: int

    def raise_own_or_peer(self, own: BaseException | None, wording: Wording) -> None:
        """Raise when any rank failed: a failing rank ``own``, the others ``RankFailedError``."""
        if not self.failures:
            return
        if own is not None:
            raise own
        raise peer_failure({r: f.text for r, f in self.failures.items()}, self.world, wording)

    def raise_one(
        self, what: str, kinds: Mapping[str, type[BaseException]], limit: int = 20
    ) -> None:
        """Raise when any rank failed, on every rank the same error: the first failing rank's
        class (from ``kinds`` by name, else ``RuntimeError``) with every rank's lines."""
        raise_one(self.failures, what, kinds, limit)


def raise_one(
    failures: Mapping[int, Failure],
    what: str,
    kinds: Mapping[str, type[BaseException]],
    limit: int = 20,
) -> None:
    """``Verdict.raise_one`` of ``failures`` (also for a verdict every rank computed alike)."""
    if not failures:
        return
    kind = kinds.get(next(iter(failures.values())).kind, RuntimeError)
    lines = by_rank((r, line) for r, f in failures.items() for line in f.lines)
    body = "\n  ".join(lines[:limit])
    raise kind(f"{what}:\n  {body}")


def agree(
    outcome: BaseException | Failure | Sequence[str] | None,
    group: dist.ProcessGroup | None = None,
    *,
    digest: Sequence[int] = (),
    detail: Any = None,
    always: bool = False,
) -> Verdict:
    """This rank's ``outcome`` (None, an exception, a ``Failure`` or findings) and ``digest``
    (non-negative ints; a negative one is never agreed to) against every rank's of ``group``.
    Every rank passes a digest of the same length, whatever its outcome (a fixed-size reduce).

    Collectives, the same on every rank: ONE ``all_reduce(MAX)`` of ``[d, -d]`` (of ``[failed]``
    without a digest; a failing rank sends ``d = -1``): 8 bytes per digest value or 8 in all,
    whatever the world size. Only when some rank failed or the digests differ (or ``always``,
    which skips the all-reduce) ONE ``all_gather_objects`` of every rank's ``(failure,
    detail)``. Which path runs is the all-reduce's result, the same on every rank. Without a
    process group: this rank alone, no collective. Nothing raises here but a collective."""
    failure = failure_of(outcome)
    values = [int(v) for v in digest]
    if not (dist.is_available() and dist.is_initialized()):
        same = failure is None and all(v >= 0 for v in values)
        return Verdict(
            {} if failure is None else {0: failure},
            same,
            None if same and not always else [detail],
            1,
        )
    world = dist.get_world_size(group)
    same = False
    if not always:
        if values:
            sent = [-1] * len(values) if failure is not None else values
            both = torch.tensor(sent + [-v for v in sent], dtype=torch.int64)
            top = comm.all_reduce_max(both, group).tolist()
            n = len(sent)
            same = all(top[i] == -top[n + i] >= 0 for i in range(n))
        else:
            flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
            same = not int(comm.all_reduce_max(flag, group)[0])
        if same:
            return Verdict({}, True, None, world)
    gathered = comm.all_gather_objects((failure, detail), group)
    failures = {r: f for r, (f, _) in enumerate(gathered) if f is not None}
    return Verdict(failures, False, [d for _, d in gathered], world)


def gather_messages(
    failure: BaseException | None, group: dist.ProcessGroup | None, device: torch.device
) -> list[str]:
    """Every rank's error message (empty for a healthy rank), ONE fixed-size all-gather."""
    text = "" if failure is None else f"{type(failure).__name__}: {failure}"
    data = text.encode("utf-8", "replace")[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = dist.get_world_size(group)
    out = torch.empty(world * _MESSAGE_BYTES, dtype=torch.uint8, device=device)
    comm.all_gather_flat(out, mine.to(device), group)
    raw = out.cpu().view(world, _MESSAGE_BYTES)
    return [bytes(raw[r].tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in range(world)]


class VerdictSlots:
    """The verdict slots of a float64 row that rides in a caller's own fixed-size all-gather,
    next to its payload: ``[failed, *arguments, magic]``.

    ``failed`` is 1 when this rank's input or arguments were refused (its arguments are then
    NaN); ``arguments`` are the values every rank must pass alike (float or bool); ``magic``
    tells this collective from a peer inside another one of the same size. The shape never
    depends on the arguments, so no mismatch can deadlock, and a healthy verdict needs no
    collective of its own.

    Args:
        arguments: Each argument's name and type (``float`` or ``bool``), in slot order.
        magic: The marker, a float64-exact value particular to this collective.
        wording: The nouns of the messages.
        mismatch: The error raised on every rank for differing arguments or a foreign row.
        keep_alive: The encoded slots may be read by a captured CUDA graph: they are listed by
            ``caches.kept_alive()``.
    """

    def __init__(
        self,
        arguments: Mapping[str, type],
        magic: float,
        wording: Wording,
        mismatch: type[RankMismatchError] = RankMismatchError,
        keep_alive: bool = False,
    ):
        self.names = tuple(arguments)
        self.types = tuple(arguments.values())
        self.magic = magic
        self.wording = wording
        self.mismatch = mismatch
        self.width = len(self.names) + 2
        self._cache: dict[tuple, torch.Tensor] = {}
        if keep_alive:
            caches.keep_alive(self._cache)

    def encode(self, device: torch.device, failed: bool, values: Sequence[float]) -> torch.Tensor:
        """This rank's slots as a float64 tensor on ``device`` that is never written (so it is
        made once per value and kept).

        Why kept: made per call, it would be a pageable host-to-device copy, and CUDA may make
        the host wait for the stream before such a copy: the host would stall behind the kernel
        it has just launched, and launch the next one late (seen on the H200: about 1 ms)."""
        key = (device, failed, None if failed else tuple(values))
        slots = self._cache.get(key)
        if slots is None:
            if len(self._cache) >= _SLOTS_CACHE_SIZE:
                self._cache.clear()
            args = [float("nan")] * len(self.names) if failed else [float(v) for v in values]
            row = [1.0 if failed else 0.0, *args, self.magic]
            host = comm.staged_for(device, row, torch.float64)
            slots = self._cache[key] = host.to(device, non_blocking=True)
        return slots

    def bad(self, gathered: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
        """On the device, no host read: some rank failed, or the ranks' arguments or markers
        differ (every rank's slots, ``world x width``, against this healthy rank's own)."""
        return (gathered != self.encode(gathered.device, False, values)).any()

    def settle(
        self,
        gathered: torch.Tensor,
        failure: BaseException | None,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        """Every rank's slots (``world x width``, on the host): raise on every rank unless every
        rank is healthy with the same arguments. A foreign row or differing arguments: ``mismatch``
        on every rank. A failed rank: every rank issues ONE fixed-size message all-gather, then
        the failing ranks raise their own ``failure``, the others ``RankFailedError``."""
        world, w = gathered.shape[0], self.wording
        foreign = [r for r in range(world) if gathered[r, -1] != self.magic]
        if foreign:
            raise self.mismatch(
                f"ranks {foreign} of the {w.where} sent something other than a {w.row}: they "
                "are inside another collective of the same size. Every rank of the group must "
                f"{w.call} at the same point, in the same order."
            )
        failed = [r for r in range(world) if gathered[r, 0] != 0]
        if failed:
            messages = gather_messages(failure, group, device)  # every rank saw the same rows
            if failure is not None:
                raise failure
            raise peer_failure({r: messages[r] for r in failed}, world, w)
        for i, (name, kind) in enumerate(zip(self.names, self.types, strict=True)):
            values = [kind(v) for v in gathered[:, 1 + i].tolist()]
            if len(set(values)) > 1:
                raise self.mismatch(
                    f"ranks of the {w.where} passed different {name}: {by_value(values)}. "
                    f"{w.why}, so every rank must pass the same {name} (check configs built per "
                    "rank, e.g. from rank-local environment variables)."
                )
