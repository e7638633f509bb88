"""The whole-param step's verdict kept on the device (``OptimizerConfig(host_sync=False)``).

A host-synced step reads every rank's status word and raises on every rank
(``_infra.attempt.Attempt.settle``).
A step that never reads the host follows the stats layer's protocol instead (``stats._reduce``,
``_infra.agreement.VerdictSlots``): every rank takes part in every collective with sizes fixed by
the agreed plan, a rank that failed sends a non-zero status word with filler, each rank folds
what it received into a 0-d bool on the device (``DeviceVerdict.bad``), and every write of the
step is gated on it. The failing rank raises its own error after the last exchange; the others
return, their step changed nothing and the wrapper reports it (``update_successful`` False, a
NaN norm). ``agree_on_device`` is the step's agreement in that mode: one all-reduce of fixed
size whose result stays on the device, read on the host only by a rank that rebuilds its plan
at this step (which reads the host anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..._infra.comm import device_constant

__all__ = ["DeviceVerdict", "agree_on_device"]


class DeviceVerdict:
    """One whole-param step's verdict on ``device``: whether any rank failed or the ranks
    disagreed, without a host read.

    Args:
        device: Where the verdict lives (the exchange group's device).
        skip: A float32 0/1 gate (a grad scaler's found_inf): the step writes nothing where it
            is 1, on every rank alike, without being a failure. None: no gate.
    """

    def __init__(self, device: torch.device, skip: torch.Tensor | None = None):
        self.device = device
        self.skip = skip
        self.error: BaseException | None = None  # this rank's own failure, raised last
        # the plan the step ran with: a rank that raises keeps it too (its peers, which return,
        # keep theirs; a plan built at this step would otherwise be rebuilt on that rank alone)
        self.plan: Any = None
        self._bad = torch.zeros((), dtype=torch.bool, device=device)  # a fill: no copy

    @property
    def bad(self) -> torch.Tensor:
        """0-d bool on the device: some rank failed or the ranks disagreed (the step wrote
        nothing on any rank). True on a rank whose own input failed."""
        if self.error is not None:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return self._bad

    def fail(self, error: BaseException) -> None:
        """This rank failed (the first error is kept): it still takes part, then raises it."""
        if self.error is None:
            self.error = error

    def fold(self, flag: torch.Tensor) -> None:
        """Add a device-side finding (a 0-d bool: something differs or a peer failed)."""
        self._bad = self._bad | flag

    def word(self) -> torch.Tensor:
        """This rank's status word for its next messages: int64 ``[1]`` on the device, 1 when
        it failed or has learned of a failure so far, else 0."""
        return self.bad.to(torch.int64).view(1)

    def gate(self) -> torch.Tensor:
        """0-d bool on the device: write nothing (a failure, a disagreement, or the skip)."""
        if self.skip is None:
            return self.bad
        return self.bad | (self.skip != 0)

    def raise_own(self) -> None:
        """After the last exchange: this rank's own failure, if it had one."""
        if self.error is not None:
            raise self.error


def agree_on_device(
    failed: bool, values: Sequence[int], group: dist.ProcessGroup | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's agreement without a host read: ONE ``all_reduce(MAX)`` of ``[failed,
    *values, -failed, *(-values)]`` (int64, fixed size) over ``group``. Returns ``(bad,
    reduced)``: ``bad`` a 0-d bool on the device (some rank failed, or some value differs
    between ranks), ``reduced`` the all-reduced slots, for a rank that reads them (the maximum
    of each slot, then the negated minimum). The slots sent are made once per value and kept
    (``device_constant``): a steady step copies nothing to the device."""
    row = [1 if failed else 0, *(int(v) for v in values)]
    sent = device_constant(device, [*row, *(-v for v in row)], torch.int64)
    reduced = sent.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    n = len(row)
    bad = (reduced[:n] != -reduced[n:]).any() | (reduced[0] > 0)
    return bad, reduced
