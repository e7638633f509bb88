"""The step as data: ``prepare`` turns the engines' grads into one ``Prepared`` record.

``Prepared`` holds what the rest of the step consumes: the stats of ONE collective over every
engine's grads (each engine's grads one *segment*, so each base optimizer's norm comes from the
same row), the deferred verdict (where the update can be gated on the device and the host
waits only after it is enqueued) and the host values read with the verdict. ``StepResult``
turns it into ``step()``'s triple and ``grad_norms``, reading the host at most once;
``clip_norms`` gives each engine the norm its clip uses under ``OptimizerConfig.clip_scope``.
The stats layer is reached through its interface module (``stats.seam``) only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra.comm import all_gather_objects
from ..stats.seam import (
    PRESENCE_PRIME,
    AgreedValuesError,
    GradPresenceError,
    GradStats,
    Parts,
    SegmentStats,
    packed_values,
    reduce_grads,
    segment_norm,
    segment_stats_of,
)
from ._agreed import AgreedSlots
from ._engines._engine import Engine, check_disjoint

__all__ = ["Prepared", "StepResult", "clip_norms", "prepare", "stats_of"]


class Prepared(NamedTuple):
    """One prepared step (see the module docstring)."""

    seg: SegmentStats
    # (bad, verdict): the update is gated on ``bad``; ``verdict()`` raises if a rank failed
    deferred: tuple[torch.Tensor, Callable[[], list[float]]] | None
    host: list[float] | None  # [found_inf, norm, zeros, *norms] read with the verdict, or None

    @property
    def stats(self) -> GradStats:
        return self.seg.stats


def _zero_stats(count_zeros: bool, segments: int) -> SegmentStats:
    zero = torch.zeros((), dtype=torch.float32)
    zeros = torch.zeros((), dtype=torch.int64) if count_zeros else None
    stats = GradStats(zero, zeros, torch.zeros((), dtype=torch.bool))
    return SegmentStats(stats, torch.zeros(segments), torch.zeros(segments, dtype=torch.float64))


def reduce(
    parts: Parts,
    *,
    segments: int,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
    in_group: bool,
    presence: tuple[int, int] = (0, 0),
    agreed: torch.Tensor | None = None,
) -> tuple[SegmentStats, list[float] | None]:
    """The stats of ``parts`` (one ``Buckets`` per engine; an exception: this rank failed; it
    joins the collective so no rank waits, then raises) and, with ``host_sync``, their host
    values read with the verdict."""
    if not in_group:  # a paramless rank outside the group
        if isinstance(parts, BaseException):
            raise parts
        return _zero_stats(count_zeros, segments), None
    kw: dict[str, Any] = dict(
        segments=segments,
        norm_type=norm_type,
        count_zeros=count_zeros,
        group=group,
        presence=presence,
        agreed=agreed,
    )
    reduced = reduce_grads(parts, read="host" if host_sync else "device", **kw)
    return reduced.seg, reduced.host


def stats_of(
    grads: Sequence[Sequence[DTensor]],
    *,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
    in_group: bool,
) -> SegmentStats:
    """The stats of ``grads`` (DTensors, one list per engine), one collective."""
    if not in_group:
        return _zero_stats(count_zeros, len(grads))
    kw: dict[str, Any] = dict(norm_type=norm_type, count_zeros=count_zeros, group=group)
    return segment_stats_of(grads, host_sync=host_sync, **kw)


def prepare(
    engines: Sequence[Engine],
    *,
    agreement: AgreedSlots,
    inv_scale_on: Any,
    norm_type: float,
    count_zeros: bool,
    group: dist.ProcessGroup | None,
    host_sync: bool,
    defer: bool,
) -> Prepared:
    """Collect every engine's grads and take their stats in ONE collective, which also carries
    this rank's hyperparameter digests (``agreement``): ranks that hold different values raise
    ``HyperparameterMismatchError`` on every rank (with the verdict read on the host; else the
    device verdict is bad, see ``SegmentStats.bad``).

    ``defer``: where every engine's update can be gated on the device, postpone the
    collective's host-side verdict until the update is enqueued (``read="deferred"``).
    On an error every engine's work grads are dropped and it is raised after the collective."""
    parts: Parts
    in_group = engines[0].table.in_stats_group
    agreed = None
    try:
        for e in engines:  # every engine validated before any grad is changed
            e.check()
        check_disjoint(engines)  # again only after a table was rebuilt
        collected = [e.collect() for e in engines]
        if inv_scale_on is not None:
            for e, part in zip(engines, collected, strict=True):
                e.preparer.unscale(inv_scale_on, part)
        parts = collected
        sums = [e.presence() for e in engines]
        presence = (
            sum(c for c, _ in sums) % PRESENCE_PRIME,
            sum(d for _, d in sums) % PRESENCE_PRIME,
        )
        if in_group:
            agreed = agreement.values(group)
    except Exception as exc:  # joins the collective, so no rank waits, then raises (below)
        parts, presence, agreed = exc, (0, 0), None
    kw: dict[str, Any] = dict(
        segments=len(engines),
        norm_type=norm_type,
        count_zeros=count_zeros,
        group=group,
        presence=presence,
        agreed=agreed,
    )
    try:
        if (
            defer
            and not isinstance(parts, BaseException)
            and in_group
            and all(e.skips_on_device() for e in engines)
        ):
            reduced = reduce_grads(parts, read="deferred", **kw)
            assert reduced.deferred is not None
            bad, verdict = reduced.deferred
            return Prepared(reduced.seg, (bad, _naming(verdict, engines, agreement, group)), None)
        seg, host = reduce(parts, host_sync=host_sync, in_group=in_group, **kw)
        return Prepared(seg, None, host)
    except GradPresenceError:
        for e in engines:
            e.drop()
        raise_absent_grads(engines, group)
        raise
    except AgreedValuesError:
        for e in engines:
            e.drop()
        agreement.raise_mismatch(group)
    except Exception:
        for e in engines:
            e.drop()
        raise


def _naming(
    verdict: Callable[[], list[float]], engines: Sequence[Engine], agreement: AgreedSlots, group
) -> Callable[[], list[float]]:
    """The deferred ``verdict`` with the errors that name params or values: the same exchanges
    as ``prepare``'s, on every rank alike (every rank saw the same rows)."""

    def named() -> list[float]:
        try:
            return verdict()
        except GradPresenceError:
            raise_absent_grads(engines, group)
            raise
        except AgreedValuesError:
            agreement.raise_mismatch(group)

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


def clip_norms(
    seg: SegmentStats, scope: str | Collection[int], norm_type: float
) -> list[torch.Tensor | None]:
    """Per engine, the norm its grads are clipped by under ``scope`` (None: not clipped):
    ``"global"`` the total, ``"per_optimizer"`` its own, a tuple of indices their joint norm
    for those engines. Device tensors, no host read."""
    k = seg.norms.numel()
    if scope == "global":
        return [seg.stats.total_norm] * k
    if scope == "per_optimizer":
        return [seg.norms[i] for i in range(k)]
    indices = sorted(int(i) for i in scope)
    if not indices:
        return [None] * k
    joint = segment_norm(seg, indices, norm_type)
    chosen = set(indices)
    return [joint if i in chosen else None for i in range(k)]


class StepResult:
    """``step()``'s return values and ``grad_norms`` from the stats, read on the host at most
    once."""

    def __init__(self, seg: SegmentStats, host: list[float] | None = None):
        self.seg = seg
        # [found_inf, norm, zeros, *norms] as read with the collective's verdict, if it was
        self.host = host

    @property
    def stats(self) -> GradStats:
        return self.seg.stats

    def _read(self) -> list[float]:
        if self.host is None:  # found_inf, norm, zeros and the norms in a single transfer
            packed = packed_values(self.stats)
            norms = self.seg.norms.to(device=packed.device, dtype=torch.float64)
            self.host = torch.cat([packed, norms]).tolist()
        return self.host

    def found_inf(self) -> bool:
        return bool(self._read()[0])

    def norms(self, on_host: bool) -> tuple[Any, ...]:
        """Each engine's pre-clip norm: floats, or 0-d device tensors (``not on_host``)."""
        if not on_host:
            return tuple(self.seg.norms.unbind())
        return tuple(self._read()[3:])

    def values(self, ok: bool, on_host: bool) -> tuple[Any, Any, Any]:
        s = self.stats
        if not on_host:
            # a fill kernel, not a host-to-device copy
            okt = torch.full((), ok, dtype=torch.bool, device=s.found_inf.device)
            return okt, s.total_norm, s.num_zeros
        v = self._read()
        return ok, v[1], (int(v[2]) if s.num_zeros is not None else None)
