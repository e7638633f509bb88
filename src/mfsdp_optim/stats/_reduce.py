"""One rank's contribution to the grad statistics, and the one collective that combines them.

Every rank of the grad-stats group sends ONE fixed-size float64 row in ONE all-gather, whatever
its arguments: ``[norm_slot, zeros, nonfinite | presence (2) | failed, norm_type, count_zeros,
magic]``, its contribution (``_math``), the wrapper's grad-presence sums (``presence_bad``) and
the verdict slots of the rank-agreement protocol
(``_infra.agreement.VerdictSlots``: a refused rank, differing arguments or a foreign row raise on
every rank; a second, fixed-size all-gather of messages only when a rank failed). Healthy case:
that one collective, combined locally (a sum, or a max for ``p = inf``); ``host_sync=False``
keeps the verdict on the device (a NaN norm and ``found_inf`` on the healthy ranks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._infra import comm
from .._infra.agreement import RankFailedError, RankMismatchError, VerdictSlots, Wording
from .._infra.comm import HostRead, collective_device
from . import _fused
from ._buckets import Buckets
from ._math import (
    NONFINITE_SLOT,
    NORM_SLOT,
    ZEROS_SLOT,
    check_norm_type,
    combine_contributions,
    empty_contribution,
    finish_norm,
    shard_contribution,
)

__all__ = [
    "PRESENCE_PRIME",
    "GradPresenceError",
    "GradStats",
    "RankFailedError",
    "StatsArgumentMismatchError",
    "packed_values",
    "reduce_buckets",
    "reduce_buckets_deferred",
    "reduce_buckets_read",
    "require_member",
]


class StatsArgumentMismatchError(RankMismatchError):
    """Ranks of the grad-stats group called with different ``norm_type`` or ``count_zeros``
    (raised on every rank), or a peer was inside another collective."""


class GradPresenceError(ValueError):
    """Some param has a grad on some ranks of its mesh and None on others (raised on every
    rank of the grad-stats group; the wrapper names the params)."""


# the grad-presence sums (the wrapper's ``presence``): each rank adds, for every param it holds
# with a grad, h / n (h: the param's hash, n: its mesh's size, mod this prime) to the first sum
# and, if it is the param's lowest mesh rank, h to the second. Over the group the sums agree
# (mod the prime) when every param has a grad on all of its mesh's ranks or on none; a param
# with a grad on k of n ranks (0 < k < n) leaves h * (k / n - [lowest has it]) != 0.
PRESENCE_PRIME = 2_147_483_647  # 2**31 - 1: float64 sums of such values are exact


# the row every rank sends: the contribution of _math (slots 0-2), then the verdict slots
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
)
_PRESENCE = NONFINITE_SLOT + 1  # the two grad-presence sums
_CONTRIBUTION = _PRESENCE + 2  # where the verdict slots start
_ROW = _CONTRIBUTION + _SLOTS.width
_PRESENCE_CACHE: dict[tuple, torch.Tensor] = {}


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


def reduce_buckets(
    buckets: Buckets | BaseException,
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool = True,
    presence: tuple[int, int] = (0, 0),
) -> GradStats:
    """The global statistics of every rank's ``buckets`` (see ``_buckets``), one collective.

    ``buckets`` may instead be the exception (any type) that building them raised on this rank:
    the rank still joins the collective, so no peer waits for it. Whenever any rank failed,
    EVERY rank raises: the failing rank its own exception, the others ``RankFailedError``
    naming it (a second, fixed-size all-gather carries the messages). ``norm_type`` and
    ``count_zeros`` must be equal on every rank (``StatsArgumentMismatchError`` on every
    rank otherwise).

    ``host_sync=False`` (the wrapper's device-only mode) reads nothing back to the host: a
    failing rank still raises its own exception right after the one collective, while the
    others cannot know without a host read, so they get ``total_norm=NaN`` and
    ``found_inf=True`` on the device (a grad scaler then skips the step on every rank).
    """
    if host_sync:
        return reduce_buckets_read(
            buckets, norm_type=norm_type, count_zeros=count_zeros, group=group, presence=presence
        )[0]
    require_member(group)
    device = collective_device(group)
    rows, failure, p, _ = _gather_rows(
        buckets, norm_type, count_zeros, group, device, presence=presence
    )
    if failure is not None:
        raise failure
    return _device_verdict(rows, p, bool(count_zeros))


def reduce_buckets_read(
    buckets: Buckets | BaseException,
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    presence: tuple[int, int] = (0, 0),
) -> tuple[GradStats, list[float]]:
    """``reduce_buckets(host_sync=True)``, and the statistics on the host from the same single
    read: ``[found_inf, total_norm]`` (+ ``[num_zeros]`` with ``count_zeros``) as floats."""
    require_member(group)
    device = collective_device(group)
    rows, failure, p, world = _gather_rows(
        buckets, norm_type, count_zeros, group, device, host_reads=True, presence=presence
    )
    stats, read = _start_read(rows, failure, p, bool(count_zeros))
    values = _verdict_on_host(read, failure, group, device, world)
    assert stats is not None  # a failure raised in the verdict
    return stats, values


def reduce_buckets_deferred(
    buckets: Buckets | BaseException,
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    presence: tuple[int, int] = (0, 0),
) -> tuple[GradStats, torch.Tensor, Callable[[], list[float]]]:
    """``reduce_buckets_read()`` with its host-side verdict postponed: ``(stats, bad, verdict)``.

    ``stats`` and ``bad`` (a 0-d bool tensor: some rank failed or ranks disagree) stay on the
    device; ``verdict()`` later does what ``reduce_buckets`` does right after the collective
    (the message gather when some rank failed, the raise) and returns the host values of
    ``reduce_buckets_read``, so a caller can enqueue device work that ``bad`` gates (the
    wrapper's fused update) before the host waits. The host copy is enqueued here, before that
    work (``comm.HostRead``): ``verdict()`` waits for the statistics, not for the update.
    A rank whose own input failed gets a ``verdict`` that raises at once; it must still call it
    at the same point as its peers, which issue the message gather there.
    """
    require_member(group)
    device = collective_device(group)
    stats_rows = _gather_rows(
        buckets, norm_type, count_zeros, group, device, host_reads=True, presence=presence
    )
    rows, failure, p, world = stats_rows
    stats, read = _start_read(rows, failure, p, bool(count_zeros))
    if stats is None:
        return (
            GradStats(torch.full((), torch.nan), None, torch.ones((), dtype=torch.bool)),
            torch.ones((), dtype=torch.bool),
            lambda: _verdict_on_host(read, failure, group, device, world),
        )
    return (
        stats,
        _bad(rows, p, bool(count_zeros)),
        lambda: _verdict_on_host(read, None, group, device, world),
    )


def _gather_rows(
    buckets: Buckets | BaseException,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
    host_reads: bool = False,
    presence: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, BaseException | None, float, int]:
    """This rank's row (contribution, presence sums, failure flag, arguments, marker) and THE
    collective: every rank's rows, ``(rows, this rank's failure, p, world)``. ``host_reads``:
    the CPU stats may read their own CPU flags before the collective (see ``stats._cpu``)."""
    failure = buckets if isinstance(buckets, BaseException) else None
    p = math.nan
    contribution = None
    if failure is None:
        try:
            p = check_norm_type(norm_type)
            if count_zeros not in (True, False):
                raise TypeError(f"count_zeros must be True or False, got {count_zeros!r}")
            contribution = _local_contribution(
                buckets,  # type: ignore[arg-type]
                p,
                bool(count_zeros),
                device,
                host_reads=host_reads,
            )
        except Exception as exc:  # any type: the peers must hear of it, not wait for it
            failure = exc
    if failure is not None:
        p, contribution = math.nan, empty_contribution(device)
    assert contribution is not None
    slots = _SLOTS.encode(device, failure is not None, (p, count_zeros is True))
    row = torch.cat([contribution, _presence_slots(device, presence), slots])
    world = dist.get_world_size(group)
    rows = row.new_empty(world * _ROW)
    comm._all_gather_flat(rows, row, group)  # THE collective: one per call on every rank
    rows = rows.view(world, _ROW)
    return rows, failure, p, world


def _presence_slots(device: torch.device, presence: tuple[int, int]) -> torch.Tensor:
    """The two presence sums as float64 on ``device``, made once per value and kept (a fresh
    host-to-device copy per step could stall the host: see ``VerdictSlots.encode``)."""
    key = (device, int(presence[0]), int(presence[1]))
    slots = _PRESENCE_CACHE.get(key)
    if slots is None:
        if len(_PRESENCE_CACHE) >= 64:
            _PRESENCE_CACHE.clear()
        slots = _PRESENCE_CACHE[key] = torch.tensor(key[1:], dtype=torch.float64).to(device)
    return slots


def presence_bad(rows: torch.Tensor) -> torch.Tensor:
    """On the device: the two presence sums of every rank's row differ (mod the prime)."""
    sums = rows[:, _PRESENCE : _PRESENCE + 2].sum(dim=0)
    return torch.remainder(sums[0] - sums[1], PRESENCE_PRIME) != 0


def _start_read(
    rows: torch.Tensor, failure: BaseException | None, p: float, count_zeros: bool
) -> tuple[GradStats | None, HostRead]:
    """The statistics (None when this rank failed) and ONE host copy, started now, of every
    rank's flags followed by the presence verdict and ``[found_inf, total_norm(, num_zeros)]``
    in float64."""
    flags = rows[:, _CONTRIBUTION:].reshape(-1)
    if failure is not None:
        return None, HostRead(flags)
    stats = _finish(rows, p, count_zeros)
    bad = presence_bad(rows).to(torch.float64).reshape(1)
    return stats, HostRead(torch.cat([flags, bad, packed_values(stats)]))


def packed_values(stats: GradStats) -> torch.Tensor:
    """``[found_inf, total_norm(, num_zeros)]`` as one float64 vector on the stats' device: the
    layout of every host read of the statistics (``reduce_buckets_read``'s values)."""
    values = [stats.found_inf, stats.total_norm]
    if stats.num_zeros is not None:
        values.append(stats.num_zeros)
    return torch.stack([v.to(torch.float64) for v in values])


def _verdict_on_host(
    read: HostRead,
    failure: BaseException | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    world: int,
) -> list[float]:
    """Wait for ``read`` (``_start_read``) and check every rank's flags (4 numbers per rank);
    raise on every rank if any failed. Returns the statistics' host values."""
    host = read.wait()
    width = _SLOTS.width
    _SLOTS.settle(host[: world * width].view(world, width), failure, group, device)
    if host[world * width]:  # the same sums on every rank: every rank raises here
        raise GradPresenceError(
            "some param has a grad on some ranks of its mesh and None on others (the "
            "grad-presence check of the grad-stats collective): every rank holding a param must "
            "have its grad, or none. Nothing was updated."
        )
    return host[world * width + 1 :].tolist()


def _finish(rows: torch.Tensor, p: float, count_zeros: bool) -> GradStats:
    total = combine_contributions(rows[:, : NONFINITE_SLOT + 1], p)
    norm = finish_norm(total[NORM_SLOT], p)
    num_zeros = total[ZEROS_SLOT].round().to(torch.int64) if count_zeros else None
    return GradStats(total_norm=norm, num_zeros=num_zeros, found_inf=total[NONFINITE_SLOT] > 0)


def _device_verdict(rows: torch.Tensor, p: float, count_zeros: bool) -> GradStats:
    """``_finish`` with every check of ``VerdictSlots.settle`` folded in on the device."""
    stats = _finish(rows, p, count_zeros)
    bad = _bad(rows, p, count_zeros)
    return GradStats(
        total_norm=torch.where(bad, torch.nan, stats.total_norm),
        num_zeros=stats.num_zeros,
        found_inf=stats.found_inf | bad,
    )


def _bad(rows: torch.Tensor, p: float, count_zeros: bool) -> torch.Tensor:
    """On the device: some rank failed, or the ranks' arguments or markers differ (every rank's
    meta slots against this healthy rank's own: one comparison, broadcast over the ranks)."""
    return _SLOTS.bad(rows[:, _CONTRIBUTION:], (p, count_zeros)) | presence_bad(rows)


def require_member(group: dist.ProcessGroup | None) -> None:
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not in the grad-stats group but called a stats function; "
            "only the group's ranks take part. Pass a group that holds every rank with grads."
        )


def _local_contribution(
    buckets: Buckets,
    norm_type: float,
    count_zeros: bool,
    device: torch.device,
    host_reads: bool = False,
) -> torch.Tensor:
    rows = [
        _bucket_contribution(tensors, norm_type, replication, canonical, count_zeros, host_reads)
        for (_, _, replication, canonical), tensors in buckets.items()
    ]
    if not rows:
        return empty_contribution(device)
    if len(rows) == 1:  # the common case, every grad in one layout: nothing to combine
        return rows[0].to(device, non_blocking=True)
    rows = [row.to(device, non_blocking=True) for row in rows]
    return combine_contributions(torch.stack(rows), norm_type)


def _bucket_contribution(
    tensors: list[torch.Tensor],
    norm_type: float,
    replication: int,
    canonical: bool,
    count_zeros: bool,
    host_reads: bool = False,
) -> torch.Tensor:
    """One bucket's contribution: the fused kernel where it applies, else multi-tensor torch
    (on CPU: ``stats._cpu``, which may read its CPU flags when ``host_reads``)."""
    kwargs: dict[str, Any] = dict(
        norm_type=norm_type, replication=replication, canonical=canonical, count_zeros=count_zeros
    )
    row = _fused.shard_contribution(tensors, **kwargs)
    if row is not None:
        return row
    return shard_contribution(tensors, host_reads=host_reads, **kwargs)
