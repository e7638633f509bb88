"""The step as data: ``prepare`` turns the engines' grads into one ``Prepared`` record.

``Prepared`` holds what the rest of the step consumes: the stats of ONE collective over every
engine's grads, the deferred verdict (where the update can be gated on the device and the host
waits only after it is enqueued) and the host values read with the verdict. ``StepResult``
turns it into ``step()``'s triple, reading the host at most once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .._infra.comm import all_gather_objects
from ..stats._buckets import Buckets, bucket_local_shards
from ..stats._reduce import (
    PRESENCE_PRIME,
    GradPresenceError,
    GradStats,
    packed_values,
    reduce_buckets,
    reduce_buckets_deferred,
    reduce_buckets_read,
)
from ._engine import Engine, check_disjoint, merge_buckets

__all__ = ["Prepared", "StepResult", "prepare", "stats_of"]


class Prepared(NamedTuple):
    """One prepared step (see the module docstring)."""

    stats: GradStats
    # (bad, verdict): the update is gated on ``bad``; ``verdict()`` raises if a rank failed
    deferred: tuple[torch.Tensor, Callable[[], list[float]]] | None
    host: list[float] | None  # [found_inf, norm(, zeros)] read with the verdict, or None


def _zero_stats(count_zeros: bool) -> GradStats:
    zero = torch.zeros((), dtype=torch.float32)
    zeros = torch.zeros((), dtype=torch.int64) if count_zeros else None
    return GradStats(zero, zeros, torch.zeros((), dtype=torch.bool))


def reduce(
    buckets: Buckets | Exception,
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
    in_group: bool,
    presence: tuple[int, int] = (0, 0),
) -> tuple[GradStats, list[float] | None]:
    """The stats of ``buckets`` (an exception: this rank failed; it joins the collective so no
    rank waits, then raises) and, with ``host_sync``, their host values read with the verdict."""
    if not in_group:  # a paramless rank outside the group
        if isinstance(buckets, Exception):
            raise buckets
        return _zero_stats(count_zeros), None
    kw: dict[str, Any] = dict(norm_type=norm_type, count_zeros=count_zeros, group=group)
    kw["presence"] = presence
    if not host_sync:
        return reduce_buckets(buckets, host_sync=False, **kw), None
    return reduce_buckets_read(buckets, **kw)


def stats_of(
    grads: list, *, norm_type: float, count_zeros: bool, group, host_sync: bool, in_group: bool
) -> GradStats:
    """The stats of ``grads`` (DTensors), one collective."""
    buckets: Buckets | Exception
    try:
        buckets = bucket_local_shards(grads, group)
    except Exception as exc:  # joins the collective, so no rank waits, then raises
        buckets = exc
    kw = dict(norm_type=norm_type, count_zeros=count_zeros, group=group)
    return reduce(buckets, host_sync=host_sync, in_group=in_group, **kw)[0]


def prepare(
    engines: Sequence[Engine],
    *,
    inv_scale_on: Any,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
    defer: bool,
) -> Prepared:
    """Collect every engine's grads and take their stats in ONE collective.

    ``defer``: where every engine's update can be gated on the device, postpone the
    collective's host-side verdict until the update is enqueued (``reduce_buckets_deferred``).
    On an error every engine's work grads are dropped and it is raised after the collective."""
    buckets: Buckets | Exception
    try:
        for e in engines:  # every engine validated before any grad is changed
            e.check()
        check_disjoint(engines)  # again only after a table was rebuilt
        parts = [e.collect() for e in engines]
        if inv_scale_on is not None:
            for e, part in zip(engines, parts, strict=True):
                e.preparer.unscale(inv_scale_on, part)
        buckets = merge_buckets(parts)
        sums = [e.presence() for e in engines]
        presence = (
            sum(c for c, _ in sums) % PRESENCE_PRIME,
            sum(d for _, d in sums) % PRESENCE_PRIME,
        )
    except Exception as exc:  # joins the collective, so no rank waits, then raises (below)
        buckets, presence = exc, (0, 0)
    in_group = engines[0].table.in_stats_group
    kw: dict[str, Any] = dict(norm_type=norm_type, count_zeros=count_zeros, group=group)
    kw["presence"] = presence
    try:
        if (
            defer
            and not isinstance(buckets, BaseException)
            and in_group
            and all(e.skips_on_device() for e in engines)
        ):
            stats, bad, verdict = reduce_buckets_deferred(buckets, **kw)
            return Prepared(stats, (bad, _naming(verdict, engines, group)), None)
        stats, host = reduce(buckets, host_sync=host_sync, in_group=in_group, **kw)
        return Prepared(stats, None, host)
    except GradPresenceError:
        for e in engines:
            e.drop()
        raise_absent_grads(engines, group)
        raise
    except Exception:
        for e in engines:
            e.drop()
        raise


def _naming(
    verdict: Callable[[], list[float]], engines: Sequence[Engine], group
) -> Callable[[], list[float]]:
    def named() -> list[float]:
        try:
            return verdict()
        except GradPresenceError:
            raise_absent_grads(engines, group)
            raise

    return named


def raise_absent_grads(engines: Sequence[Engine], group: dist.ProcessGroup | None) -> None:
    """After the stats collective found grads present on some ranks of a param's mesh only
    (every rank found it alike): ONE object gather of every rank's (name, mesh ranks, has a
    grad), then ``GradPresenceError`` naming the params, on every rank."""
    mine = [
        (s.fqn, tuple(s.param.device_mesh.mesh.flatten().tolist()), s.param.grad is not None)
        for e in engines
        for s in e.table.slots
    ]
    rank = dist.get_rank()
    have: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[int]]] = {}
    for glob, entries in all_gather_objects((rank, mine), group):
        for name, ranks, present in entries:
            have.setdefault((name, ranks), ([], []))[0 if present else 1].append(glob)
    found = [
        f"param {name!r} has a grad on ranks {sorted(yes)} and None on ranks {sorted(no)}"
        for (name, _), (yes, no) in have.items()
        if yes and no
    ]
    raise GradPresenceError(
        "; ".join(found[:5] or ["a param's grad is None on some ranks of its mesh only"])
        + (f" (and {len(found) - 5} more)" if len(found) > 5 else "")
        + ". Every rank holding a param must have its grad, or none (an unused param on some "
        "ranks only, or zero_grad on some ranks only); stepping it on the others would make "
        "its shards and replicas differ. Nothing was updated."
    )


class StepResult:
    """``step()``'s return values from the stats, read on the host at most once."""

    def __init__(self, stats: GradStats, host: list[float] | None = None):
        self.stats = stats
        # [found_inf, norm(, zeros)] as read with the collective's verdict, if it was
        self.host = host

    def _read(self) -> list[float]:
        if self.host is None:  # found_inf, norm and zeros in a single transfer
            self.host = packed_values(self.stats).tolist()
        return self.host

    def found_inf(self) -> bool:
        return bool(self._read()[0])

    def values(self, ok: bool, on_host: bool) -> tuple[Any, Any, Any]:
        s = self.stats
        if not on_host:
            # a fill kernel, not a host-to-device copy
            okt = torch.full((), ok, dtype=torch.bool, device=s.found_inf.device)
            return okt, s.total_norm, s.num_zeros
        v = self._read()
        return ok, v[1], (int(v[2]) if s.num_zeros is not None else None)
