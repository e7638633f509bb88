"""One rank's contribution to the grad statistics, and the one collective that combines them.

Every rank of the grad-stats group sends ONE fixed-size float64 row in ONE all-gather, whatever
its arguments: ``[norm_slot, zeros, nonfinite | presence (2) | segment norm slots | agreed (3) |
failed, norm_type, count_zeros, magic]``, its contribution (``_math``), the wrapper's
grad-presence sums (``presence_bad``), one norm slot per *segment* when the grads come in several
(the wrapper's base optimizers: their norms ride in the same row; a single segment adds no slot),
the caller's *agreed* values (the wrapper's hyperparameter digest: ``AGREED_WIDTH`` floats that
must be equal on every rank; zeros for the stats functions; ``AgreedValuesError`` on every rank
when they differ) and the verdict slots of the rank-agreement protocol
(``_infra.agreement.VerdictSlots``: a refused rank, differing arguments or a foreign row raise on
every rank; a second, fixed-size all-gather of messages only when a rank failed). Healthy case:
that one collective, combined locally (a sum, or a max for ``p = inf``). ``reduce_grads`` is
the one entry; its ``read`` says where the verdict is read: on the host at once, never (kept on
the device: a NaN norm and ``found_inf`` on the healthy ranks), or later (deferred).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from .._infra import caches, comm
from .._infra.agreement import (
    RankFailedError,
    RankMismatchError,
    VerdictSlots,
    Wording,
    by_value,
)
from .._infra.comm import HostRead, collective_device
from ._buckets import Buckets
from ._contribution import local_contribution  # imports _fused: its caches are kept first
from ._math import (
    NONFINITE_SLOT,
    NORM_SLOT,
    ZEROS_SLOT,
    check_norm_type,
    combine_contributions,
    finish_norm,
)

__all__ = [
    "AGREED_WIDTH",
    "PRESENCE_PRIME",
    "AgreedValuesError",
    "GradPresenceError",
    "GradStats",
    "RankFailedError",
    "StatsArgumentMismatchError",
    "Parts",
    "SegmentStats",
    "Read",
    "Reduced",
    "packed_values",
    "reduce_grads",
    "require_member",
    "segment_norm",
]

# the grads of one call: one ``Buckets`` per segment (a bare ``Buckets`` is one segment), or the
# exception that collecting them raised on this rank
Parts = Buckets | Sequence[Buckets] | BaseException


class StatsArgumentMismatchError(RankMismatchError):
    """Ranks of the grad-stats group called with different ``norm_type`` or ``count_zeros``
    (raised on every rank), or a peer was inside another collective."""


class AgreedValuesError(RankMismatchError):
    """The ``agreed`` values of the grad-stats row differ between ranks (raised on every rank:
    every rank saw every rank's row; the wrapper turns it into its own error naming the values).

    Attributes:
        ranks: Each group rank's agreed values, as floats (equal on every rank).
    """

    def __init__(self, message: str, ranks: list[tuple[float, ...]]):
        super().__init__(message)
        self.ranks = ranks


class GradPresenceError(ValueError):
    """Some param has a grad on some ranks of its mesh and None on others (raised on every
    rank of the grad-stats group; the wrapper names the params)."""


# the grad-presence sums (the wrapper's ``presence``): each rank adds, for every param it holds
# with a grad, h / n (h: the param's hash, n: its mesh's size, mod this prime) to the first sum
# and, if it is the param's lowest mesh rank, h to the second. Over the group the sums agree
# (mod the prime) when every param has a grad on all of its mesh's ranks or on none; a param
# with a grad on k of n ranks (0 < k < n) leaves h * (k / n - [lowest has it]) != 0.
PRESENCE_PRIME = 2_147_483_647  # 2**31 - 1: float64 sums of such values are exact
AGREED_WIDTH = 3  # the agreed values every row carries (the wrapper's: a host and two device
# digests of its hyperparameters)


# the row every rank sends: the contribution of _math (slots 0-2), the two presence sums, the
# segment norm slots (several segments only), the agreed values, then the verdict slots
# [failed, norm_type, count_zeros, magic] of the rank-agreement protocol
_SLOTS = VerdictSlots(
    {"norm_type": float, "count_zeros": bool},
    magic=1_836_016_496.0,  # b"mfsp" as an integer: exact in float64
    wording=Wording(
        what="grad statistics",
        where="grad-stats group",
        row="grad-stats row",
        call="call the stats functions (or the wrapper's step)",
        why="The statistic is one global number",
    ),
    mismatch=StatsArgumentMismatchError,
    keep_alive=True,  # a captured step reads them
)
_CONTRIBUTION = NONFINITE_SLOT + 1  # the width of one contribution
_PRESENCE = _CONTRIBUTION  # the two grad-presence sums
_SEGMENTS = _PRESENCE + 2  # where the segment norm slots start
_CONSTANTS: dict[tuple, torch.Tensor] = {}  # _constant_slots
caches.keep_alive(_CONSTANTS)  # a captured step reads them
_NO_AGREED = (0.0,) * AGREED_WIDTH


def _segment_width(segments: int) -> int:
    """Extra norm slots in the row: one per segment, none for a single segment (its norm is
    the total)."""
    return segments if segments > 1 else 0


def _row_width(segments: int) -> int:
    return _SEGMENTS + _segment_width(segments) + AGREED_WIDTH + _SLOTS.width


# every rank's agreed values and verdict slots: the tail of the row, read on the host together
_TAIL = AGREED_WIDTH + _SLOTS.width


class GradStats(NamedTuple):
    """Global gradient statistics, equal on every rank of the grad-stats group.

    Attributes:
        total_norm: 0-d float32, the norm of the concatenation of the global tensors.
        num_zeros: 0-d int64, zero elements of the global tensors, each counted once (None when
            not asked for).
        found_inf: 0-d bool, True on every rank when any element of any local shard on any
            rank, replicas included, is NaN or inf.
    """

    total_norm: torch.Tensor
    num_zeros: torch.Tensor | None
    found_inf: torch.Tensor


class SegmentStats(NamedTuple):
    """``GradStats`` of every segment together, with each segment's own norm from the same row.

    Attributes:
        stats: The statistics over every segment's grads.
        norms: 1-D float32, each segment's norm (pre-clip), equal on every rank; NaN where the
            device-side verdict found a failed rank (like ``stats.total_norm``).
        slots: 1-D float64, each segment's combined norm slot (``sum |x|**p``, or ``max|x|`` for
            ``p = inf``): what ``segment_norm`` combines for the norm of several segments.
        bad: 0-d bool on the device, from the device-side verdict (``read="device"``): some
            rank failed, or ranks' arguments, grad presence or agreed values differ; the
            statistics are then NaN. None where the verdict was read on the host.
    """

    stats: GradStats
    norms: torch.Tensor
    slots: torch.Tensor
    bad: torch.Tensor | None = None


def segment_norm(seg: SegmentStats, indices: Sequence[int], norm_type: float) -> torch.Tensor:
    """The norm of the concatenated grads of the segments ``indices`` (0-d float32, on the
    device, no host read): their slots combined as the ranks' are (a sum, a max for ``inf``)."""
    p = float(norm_type)
    idx = list(indices)
    if len(idx) == seg.norms.numel():
        return seg.stats.total_norm
    if len(idx) == 1:
        return seg.norms[idx[0]]
    # views stacked, not an index tensor: no host-to-device copy (CUDA-graph safe)
    chosen = torch.stack([seg.slots[i] for i in idx])
    slot = chosen.amax() if math.isinf(p) else chosen.sum()
    return finish_norm(slot, p)


Read = Literal["host", "device", "deferred"]


class Reduced(NamedTuple):
    """What ``reduce_grads`` returns; ``read`` chose which of ``host`` and ``deferred`` is set.

    Attributes:
        seg: The statistics on the device. ``read="device"``: the verdict folded in
            (``SegmentStats.bad``; NaN statistics where it is bad).
        host: ``read="host"``: ``[found_inf, total_norm, num_zeros, *segment norms]`` as floats
            (``num_zeros`` 0 unless counted), read on the host with the verdict; else None.
        deferred: ``read="deferred"``: ``(bad, verdict)``, ``bad`` a 0-d bool on the device
            (some rank failed or ranks disagree) and ``verdict()`` the host read and the checks
            that ``read="host"`` does at once, returning its ``host`` values; else None.
    """

    seg: SegmentStats
    host: list[float] | None = None
    deferred: tuple[torch.Tensor, Callable[[], list[float]]] | None = None


_READS = ("host", "device", "deferred")


def reduce_grads(
    parts: Parts,
    *,
    segments: int = 1,
    read: Read = "host",
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    presence: tuple[int, int] = (0, 0),
    agreed: torch.Tensor | None = None,
) -> Reduced:
    """The global statistics of every rank's ``parts``, from ONE collective: the totals and,
    over ``segments`` segments, each segment's norm from the same row.

    ``parts``: one ``Buckets`` per segment (a bare ``Buckets`` is one segment; every rank the
    same number), or the exception (any type) that building them raised on this rank: the rank
    still joins the collective, so no peer waits for it. ``norm_type`` and ``count_zeros`` must
    be equal on every rank; so must ``agreed`` (``AGREED_WIDTH`` float64 values on the group's
    device; zeros if None) and the grad-presence sums ``presence`` (mod ``PRESENCE_PRIME``).

    ``read`` says where the verdict is read:

    - ``"host"``: at once. Whenever any rank failed, EVERY rank raises: the failing rank its own
      exception, the others ``RankFailedError`` naming it (a second, fixed-size all-gather
      carries the messages); differing arguments: ``StatsArgumentMismatchError``; differing
      agreed values: ``AgreedValuesError``; presence sums that differ: ``GradPresenceError``,
      each on every rank.
    - ``"device"``: never (nothing read back to the host). A failing rank still raises its own
      exception right after the collective; the others cannot know without a host read, so
      they get ``total_norm=NaN`` and ``found_inf=True`` (a grad scaler then skips the step on
      every rank), and every check above makes ``seg.bad`` set.
    - ``"deferred"``: later, by ``verdict()`` (``Reduced.deferred``), so a caller can enqueue
      device work that ``bad`` gates (the wrapper's fused update) before the host waits. The
      host copy is enqueued here, before that work (``comm.HostRead``): ``verdict()`` waits for
      the statistics, not for the update. A rank whose own input failed gets a ``verdict`` that
      raises at once; it must still call it at the same point as its peers, which issue the
      message gather there.
    """
    if read not in _READS:
        raise ValueError(f"read must be one of {_READS}, got {read!r}")
    require_member(group)
    device = collective_device(group)
    host_reads = read != "device"
    rows, failure, p, world = _gather_rows(
        parts, norm_type, count_zeros, group, device, segments, host_reads, presence, agreed
    )
    zeros = bool(count_zeros)
    if read == "device":
        if failure is not None:
            raise failure
        return Reduced(_device_verdict(rows, p, zeros, segments))
    seg, pending = _start_read(rows, failure, p, zeros, segments)
    if read == "host":
        values = _verdict_on_host(pending, failure, group, device, world)
        assert seg is not None  # a failure raised in the verdict
        return Reduced(seg, host=values)

    def verdict() -> list[float]:
        return _verdict_on_host(pending, failure, group, device, world)

    if seg is None:  # this rank failed: its verdict raises
        nan = torch.full((segments,), torch.nan)
        failed = GradStats(torch.full((), torch.nan), None, torch.ones((), dtype=torch.bool))
        seg = SegmentStats(failed, nan, nan.double())
        return Reduced(seg, deferred=(torch.ones((), dtype=torch.bool), verdict))
    return Reduced(seg, deferred=(_bad(rows, p, zeros), verdict))


def _gather_rows(
    parts: Parts,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
    segments: int,
    host_reads: bool = False,
    presence: tuple[int, int] = (0, 0),
    agreed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BaseException | None, float, int]:
    """This rank's row (contribution, presence sums, segment norm slots, agreed values, failure
    flag, arguments, marker) and THE collective: every rank's rows, ``(rows, this rank's
    failure, p, world)``.
    ``host_reads``: the CPU stats may read their own CPU flags before the collective (see
    ``stats._cpu``). The row's width depends on ``segments`` alone, never on the input."""
    failure = parts if isinstance(parts, BaseException) else None
    p = math.nan
    contribution = None
    if failure is None:
        try:
            p = check_norm_type(norm_type)
            if count_zeros not in (True, False):
                raise TypeError(f"count_zeros must be True or False, got {count_zeros!r}")
            contribution = local_contribution(
                _as_segments(parts, segments),  # type: ignore[arg-type]
                p,
                bool(count_zeros),
                device,
                host_reads=host_reads,
            )
        except Exception as exc:  # any type: the peers must hear of it, not wait for it
            failure = exc
    if failure is not None:
        p = math.nan
        contribution = torch.zeros(_CONTRIBUTION + _segment_width(segments), device=device)
        contribution = contribution.to(torch.float64)
    assert contribution is not None
    slots = _SLOTS.encode(device, failure is not None, (p, count_zeros is True))
    if agreed is None or failure is not None:
        agreed = _constant_slots(device, _NO_AGREED)
    row = torch.cat(
        [
            contribution[:_CONTRIBUTION],
            _constant_slots(device, (float(presence[0]), float(presence[1]))),
            contribution[_CONTRIBUTION:],
            agreed,
            slots,
        ]
    )
    world = dist.get_world_size(group)
    width = _row_width(segments)
    rows = row.new_empty(world * width)
    comm.all_gather_flat(rows, row, group)  # THE collective: one per call on every rank
    rows = rows.view(world, width)
    return rows, failure, p, world


def _constant_slots(device: torch.device, values: tuple[float, ...]) -> torch.Tensor:
    """``values`` (the presence sums, zero agreed values) as float64 on ``device``, made once
    per value and kept (a fresh host-to-device copy per step could stall the host: see
    ``VerdictSlots.encode``); copied from pinned memory, so even the first step does not
    synchronise."""
    key = (device, values)
    slots = _CONSTANTS.get(key)
    if slots is None:
        if len(_CONSTANTS) >= 64:
            _CONSTANTS.clear()
        host = comm.staged_for(device, list(values), torch.float64)
        slots = _CONSTANTS[key] = host.to(device, non_blocking=True)
    return slots


def agreed_bad(rows: torch.Tensor) -> torch.Tensor:
    """On the device: some rank's agreed values differ from the first rank's."""
    agreed = rows[:, -_TAIL : -_SLOTS.width]
    return (agreed != agreed[:1]).any()


def presence_bad(rows: torch.Tensor) -> torch.Tensor:
    """On the device: the two presence sums of every rank's row differ (mod the prime)."""
    sums = rows[:, _PRESENCE : _PRESENCE + 2].sum(dim=0)
    return torch.remainder(sums[0] - sums[1], PRESENCE_PRIME) != 0


def _as_segments(parts: Buckets | Sequence[Buckets], segments: int) -> list[Buckets]:
    """``parts`` as a list of ``segments`` bucket dicts (a bare dict is one segment)."""
    listed = [parts] if isinstance(parts, dict) else list(parts)
    if len(listed) != segments:
        raise ValueError(f"expected grads in {segments} segments, got {len(listed)}")
    return listed  # type: ignore[return-value]


def _start_read(
    rows: torch.Tensor, failure: BaseException | None, p: float, count_zeros: bool, segments: int
) -> tuple[SegmentStats | None, HostRead]:
    """The statistics (None when this rank failed) and ONE host copy, started now, of every
    rank's agreed values and flags followed by the presence verdict and ``[found_inf,
    total_norm, num_zeros, *segment norms]`` in float64."""
    flags = rows[:, -_TAIL:].reshape(-1)
    if failure is not None:
        return None, HostRead(flags)
    seg = _finish(rows, p, count_zeros, segments)
    bad = presence_bad(rows).to(torch.float64).reshape(1)
    return seg, HostRead(torch.cat([flags, bad, packed_values(seg.stats), seg.norms.double()]))


def packed_values(stats: GradStats) -> torch.Tensor:
    """``[found_inf, total_norm, num_zeros]`` as one float64 vector on the stats' device
    (``num_zeros`` 0 when not counted): the head of every host read of the statistics."""
    zeros = stats.num_zeros if stats.num_zeros is not None else torch.zeros_like(stats.found_inf)
    values = [stats.found_inf, stats.total_norm, zeros]
    return torch.stack([v.to(torch.float64) for v in values])


def _verdict_on_host(
    read: HostRead,
    failure: BaseException | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world: int,
) -> list[float]:
    """Wait for ``read`` (``_start_read``) and check every rank's flags (4 numbers per rank),
    then agreed values (3 per rank); raise on every rank if any failed or they differ. Returns
    the statistics' host values."""
    host = read.wait()
    width = _TAIL
    tail = host[: world * width].view(world, width)
    _SLOTS.settle(tail[:, AGREED_WIDTH:], failure, group, device)
    _settle_agreed(tail[:, :AGREED_WIDTH], world)
    if host[world * width]:  # the same sums on every rank: every rank raises here
        raise GradPresenceError(
            "some param has a grad on some ranks of its mesh and None on others (the "
            "grad-presence check of the grad-stats collective): every rank holding a param must "
            "have its grad, or none. Nothing was updated."
        )
    return host[world * width + 1 :].tolist()


def _settle_agreed(agreed: torch.Tensor, world: int) -> None:
    """Every rank's agreed values (``world x AGREED_WIDTH``, on the host, the same on every
    rank): ``AgreedValuesError`` on every rank unless they are equal."""
    values = [tuple(row) for row in agreed.tolist()]
    if len(set(values)) > 1:
        groups = by_value(values)
        raise AgreedValuesError(
            f"the agreed values of the {world}-rank grad-stats group differ: {groups}", values
        )


def _finish(rows: torch.Tensor, p: float, count_zeros: bool, segments: int) -> SegmentStats:
    total = combine_contributions(rows[:, :_CONTRIBUTION], p)
    norm = finish_norm(total[NORM_SLOT], p)
    num_zeros = total[ZEROS_SLOT].round().to(torch.int64) if count_zeros else None
    stats = GradStats(total_norm=norm, num_zeros=num_zeros, found_inf=total[NONFINITE_SLOT] > 0)
    if segments == 1:
        return SegmentStats(stats, norm.view(1), total[NORM_SLOT : NORM_SLOT + 1])
    part = rows[:, _SEGMENTS : _SEGMENTS + segments]
    slots = part.amax(dim=0) if math.isinf(p) else part.sum(dim=0)
    return SegmentStats(stats, finish_norm(slots, p), slots)


def _device_verdict(rows: torch.Tensor, p: float, count_zeros: bool, segments: int) -> SegmentStats:
    """``_finish`` with every check of ``VerdictSlots.settle`` folded in on the device."""
    seg = _finish(rows, p, count_zeros, segments)
    bad = _bad(rows, p, count_zeros)
    stats = GradStats(
        total_norm=torch.where(bad, torch.nan, seg.stats.total_norm),
        num_zeros=seg.stats.num_zeros,
        found_inf=seg.stats.found_inf | bad,
    )
    return SegmentStats(
        stats,
        torch.where(bad, torch.nan, seg.norms),
        torch.where(bad, torch.nan, seg.slots),
        bad,
    )


def _bad(rows: torch.Tensor, p: float, count_zeros: bool) -> torch.Tensor:
    """On the device: some rank failed, or the ranks' arguments or markers differ (every rank's
    meta slots against this healthy rank's own: one comparison, broadcast over the ranks), or
    the grad-presence sums or the agreed values do."""
    verdict = _SLOTS.bad(rows[:, -_SLOTS.width :], (p, count_zeros))
    return verdict | presence_bad(rows) | agreed_bad(rows)


def require_member(group: dist.ProcessGroup | None) -> None:
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the grad-stats group but called a stats function; "
            "only the group's ranks take part. Pass a group that holds every rank with grads."
        )
