"""Agreed hyperparameters: every rank's param groups hold the same values, checked for free.

Map: ``canonical`` is one group value's exact, rank-independent text (a number by its value, a
tensor by its dtype, shape and values; a device tensor's values stay on the device);
``GroupDigests`` one base optimizer's per-group digests, recomputed only for the groups whose
values changed; ``AgreedSlots`` the wrapper's ``AGREED_WIDTH`` float64 values that ride in the
grad-stats row (a host digest of every base optimizer's groups, uploaded only when it changes,
and two digests of the device tensors among them, computed on the device at every step, no
host read); ``raise_mismatch`` the failure path, after the row showed digests that differ: ONE
object exchange of every rank's values (the agreement protocol's, so a rank that fails to
describe its own still joins it) and ``HyperparameterMismatchError`` on every rank, naming the
optimizer, group, key and each rank's value. ``OptimizerConfig.rank_dependent_keys`` leaves
keys out. Contract: docs/concepts.md, "Ranks agree on hyperparameters".
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._infra import caches
from .._infra.agreement import RankMismatchError, Wording, agree, digest
from .._infra.comm import collective_device, staged_for
from ..stats.seam import AGREED_WIDTH

__all__ = [
    "AgreedSlots",
    "GroupDigests",
    "HyperparameterMismatchError",
    "canonical",
    "device_digest",
]

_MUTABLE = (list, dict, set, bytearray, torch.Tensor)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_HOST_BITS = 52  # the host digest as a float64 integer: exact
_PRIME = 2_147_483_647  # 2**31 - 1: a term below it times a weight below it fits int64
_BASES = (48_271, 69_621)  # two multipliers of that prime's multiplicative group
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}
caches.register(_WEIGHTS.clear)
_WORDING = Wording(what="the hyperparameter exchange", where="grad-stats group")
_LIMIT = 20  # differences named in one message


class HyperparameterMismatchError(RankMismatchError):
    """Ranks hold different hyperparameter values (raised on every rank of the grad-stats group
    by ``step()``, before anything changed).

    A ``ValueError``. Each rank would update its shards with its own values, so the model would
    become a mixture of optimizers. Set the same values on every rank; keys whose values differ
    on purpose go in ``OptimizerConfig(rank_dependent_keys=...)``.

    Args:
        message: The error message (it names each differing key and each rank's value).
        differences: See the attribute.

    Attributes:
        differences: One ``(where, values)`` pair per difference: ``where`` names the base
            optimizer, group and key (``"AdamW param_groups[0]['lr']"``), ``values`` maps each
            group rank to its value as text (``"absent"`` where a rank lacks the key).
    """

    def __init__(self, message: str, differences: list[tuple[str, dict[int, str]]]):
        super().__init__(message)
        self.differences = differences


# ------------------------------------------------------------------------------ one value


def canonical(value: Any, device_tensors: list[torch.Tensor] | None) -> str:
    """``value``'s text, equal on two ranks iff the values are: numbers by value (``1`` and
    ``1.0`` alike, bools apart), tuples and lists alike, a tensor by dtype, shape, device type
    and values. A tensor off the CPU is appended to ``device_tensors`` and stands for its
    values here (they are compared on the device); with ``device_tensors=None`` its values are
    read (the failure path)."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, numbers.Real):
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond float64's range
            return repr(value)
        if math.isnan(as_float):
            return "nan"
        return repr(as_float) if as_float == value else repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_text(value, device_tensors)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(canonical(v, device_tensors) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted((repr(k), canonical(v, device_tensors)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}:{_ADDRESS.sub('', repr(value))}"


def _tensor_text(value: torch.Tensor, device_tensors: list[torch.Tensor] | None) -> str:
    t = value._local_tensor if isinstance(value, DTensor) else value
    t = t.detach()
    head = f"tensor[{t.dtype},{tuple(t.shape)},{t.device.type}]"
    if t.device.type != "cpu" and device_tensors is not None:
        device_tensors.append(t)
        return head
    return f"{head}{t.cpu().tolist()!r}"


def shown(value: Any) -> str:
    """``value`` for a message: as the user wrote it, tensors without their device index (which
    differs between ranks), memory addresses dropped."""
    if isinstance(value, torch.Tensor):
        t = value._local_tensor if isinstance(value, DTensor) else value
        t = t.detach()
        return f"tensor({t.cpu().tolist()!r}, dtype={t.dtype}, device={t.device.type})"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(shown(v) for v in value)
        return (
            f"({inner}{',' if len(value) == 1 else ''})"
            if isinstance(value, tuple)
            else f"[{inner}]"
        )
    return _ADDRESS.sub("", repr(value))


# ------------------------------------------------------------------------ one optimizer


class GroupDigests:
    """One base optimizer's groups, each as a digest of its values (keys but ``params`` and
    ``skip``) and the device tensors among them; ``update`` recomputes a group only when a key
    changed, a value is another object, or a value may change in place (a list or tensor)."""

    def __init__(self, optimizer: torch.optim.Optimizer, skip: frozenset[str]):
        self.optimizer = optimizer
        self.skip = skip | {"params"}
        self._seen: list[tuple[tuple, tuple, bool] | None] = []
        self._parts: list[tuple[int, list[torch.Tensor]]] = []

    def update(self) -> bool:
        """Bring every group's digest up to date; True when any digest was recomputed."""
        groups = self.optimizer.param_groups
        changed = len(groups) != len(self._parts)
        if changed:
            self._seen = [None] * len(groups)
            self._parts = [(0, [])] * len(groups)
        for i, group in enumerate(groups):
            keys, values = tuple(group), tuple(group.values())
            seen = self._seen[i]
            if (
                seen is not None
                and not seen[2]
                and seen[0] == keys
                and all(map(operator.is_, seen[1], values))
            ):
                continue
            self._parts[i] = self._digest(group)
            mutable = any(isinstance(v, _MUTABLE) for k, v in group.items() if k != "params")
            self._seen[i] = (keys, values, mutable)
            changed = True
        return changed

    def _digest(self, group: dict[str, Any]) -> tuple[int, list[torch.Tensor]]:
        devices: list[torch.Tensor] = []
        text = ";".join(
            f"{k!r}={canonical(v, devices)}" for k, v in sorted(group.items()) if k not in self.skip
        )
        return digest(text)[0], devices

    def text(self) -> str:
        """The optimizer's class and every group's digest (after ``update``)."""
        kind = type(self.optimizer)
        return f"{kind.__module__}.{kind.__qualname__}:{[d for d, _ in self._parts]}"

    def device_tensors(self) -> list[torch.Tensor]:
        return [t for _, devices in self._parts for t in devices]

    def describe(self) -> tuple[str, list[dict[str, tuple[str, str]]]]:
        """The class name and each group's ``{key: (exact text, shown)}`` (values read, device
        tensors too): this rank's part of the failure path's exchange."""
        groups = [
            {str(k): (canonical(v, None), shown(v)) for k, v in g.items() if k not in self.skip}
            for g in self.optimizer.param_groups
        ]
        return type(self.optimizer).__name__, groups


# --------------------------------------------------------------------- the row's values


def device_digest(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Two polynomial digests (mod 2**31 - 1) of the bit patterns of ``tensors``' elements, in
    order: a 1-D float64 tensor of 2 on ``device``, computed there (no host read). Equal
    tensors give equal digests; tensors that differ in k elements collide with probability
    about k / 2**31 per digest."""
    bits = torch.cat([_bit_pattern(t).to(device, non_blocking=True) for t in tensors])
    weighted = bits.remainder(_PRIME).unsqueeze(0) * _weights(device, bits.numel())
    return weighted.remainder(_PRIME).sum(dim=1).remainder(_PRIME).to(torch.float64)


def _bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as int64 holding their bit patterns (complex: real and imaginary)."""
    flat = torch.view_as_real(t) if t.is_complex() else t
    flat = flat.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """``[[b**1, ..., b**n] mod p for b in _BASES]`` as int64 on ``device``, made once per
    length (from pinned memory: no host wait)."""
    key = (device, n)
    weights = _WEIGHTS.get(key)
    if weights is None:
        rows = []
        for base in _BASES:
            w, row = 1, []
            for _ in range(n):
                w = w * base % _PRIME
                row.append(float(w))
            rows.append(row)
        flat = staged_for(device, [x for row in rows for x in row], torch.int64)
        weights = _WEIGHTS[key] = flat.to(device, non_blocking=True).view(len(_BASES), n)
    return weights


class AgreedSlots:
    """The wrapper's agreed values in the grad-stats row: ``[host digest, device digest x 2]``.

    ``values(group)`` brings every base optimizer's digests up to date and returns the
    ``AGREED_WIDTH`` float64 values on the group's device: the persistent ``buffer`` itself where
    no group holds a device tensor (its host digest is uploaded, from pinned memory without a
    wait, only when it changed; a captured step reads the same buffer at every replay, after
    ``refresh``), else the buffer's first value beside the device tensors' digests, computed
    now on the device.

    Args:
        optimizers: The base optimizers, in the wrapper's order.
        skip: Keys left out (``OptimizerConfig.rank_dependent_keys``).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], skip: Collection[str]):
        self.skip = frozenset(skip)
        self.digests = [GroupDigests(o, self.skip) for o in optimizers]
        self.buffer: torch.Tensor | None = None
        self._host: float | None = None
        self._device: tuple[Any, torch.device] | None = None  # (group, its device)

    def values(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        buffer = self.refresh(group)
        tensors = [t for d in self.digests for t in d.device_tensors()]
        if not tensors:
            return buffer
        return torch.cat([buffer[:1], device_digest(tensors, buffer.device)])

    def refresh(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Every digest up to date, the host digest uploaded if it changed: the buffer."""
        if self._device is None or self._device[0] is not group:
            self._device = (group, collective_device(group))
        device = self._device[1]
        changed = any([d.update() for d in self.digests])  # every one updated (no short cut)
        if self.buffer is None or self.buffer.device != device:
            self.buffer = torch.zeros(AGREED_WIDTH, dtype=torch.float64, device=device)
            self._host = None
        if changed or self._host is None:
            self._upload()
        return self.buffer

    def _upload(self) -> None:
        buffer = self.buffer
        assert buffer is not None
        text = f"{sorted(self.skip)}|" + "|".join(d.text() for d in self.digests)
        value = float(digest(text)[0] >> (62 - _HOST_BITS))
        if value == self._host:
            return
        if buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a captured copy would replay this value at every later step: the capture fails
            # (and the step runs eagerly from then on) rather than freezing a stale digest
            raise RuntimeError("a hyperparameter changed while the step was being captured")
        self._host = value
        buffer[:1].copy_(staged_for(buffer.device, [value], torch.float64), non_blocking=True)

    def describe(self) -> dict[str, Any]:
        """This rank's values for the failure path's exchange (plain, picklable data)."""
        return {"skip": sorted(self.skip), "optimizers": [d.describe() for d in self.digests]}

    def raise_mismatch(self, group: dist.ProcessGroup | None) -> NoReturn:
        """After the grad-stats row showed different digests (every rank saw the same rows, so
        every rank is here): ONE object exchange of every rank's values, then the error naming
        each difference, on every rank. A rank that cannot describe its values still joins the
        exchange and raises its own error; the others ``RankFailedError`` naming it."""
        error: BaseException | None = None
        mine: Any = None
        try:
            mine = self.describe()
        except Exception as exc:  # any type: the peers must hear of it, not wait for it
            error = exc
        verdict = agree(error, group, detail=mine, always=True)
        verdict.raise_own_or_peer(error, _WORDING)
        raise mismatch_error(verdict.details or [])


# ------------------------------------------------------------------------ the message


def mismatch_error(everyone: list[dict[str, Any]]) -> HyperparameterMismatchError:
    """The error every rank raises, from every rank's ``describe()`` (group-rank order)."""
    found = differences(everyone)
    lines = [f"{where}: {_by_rank(values)}" for where, values in found]
    if not lines:  # the digests differed, the values read now do not (a device tensor moved)
        lines = [
            "the values read after the step's collective are equal on every rank; a "
            "tensor value changed in place during the step (on some ranks only?)"
        ]
    more = f"\n  (and {len(lines) - _LIMIT} more)" if len(lines) > _LIMIT else ""
    body = "\n  ".join(lines[:_LIMIT]) + more
    return HyperparameterMismatchError(
        f"ranks of the {len(everyone)}-rank grad-stats group hold different hyperparameters, "
        f"so each would update its shards with its own values:\n  {body}\n"
        "Nothing was updated. Set the same values on every rank (look for param_groups edits "
        "under `if rank == ...`, an lr scheduler driven by a rank-local counter, a config read "
        "per node); for values that differ on purpose, name their keys in "
        "OptimizerConfig(rank_dependent_keys=...).",
        found,
    )


def differences(everyone: list[dict[str, Any]]) -> list[tuple[str, dict[int, str]]]:
    """Every place where the ranks' descriptions differ: ``(where, {rank: value})``."""
    found: list[tuple[str, dict[int, str]]] = []
    _compare(
        found, "OptimizerConfig.rank_dependent_keys", [(repr(d["skip"]),) * 2 for d in everyone]
    )
    counts = [len(d["optimizers"]) for d in everyone]
    _compare(found, "the number of base optimizers", [(str(n), str(n)) for n in counts])
    several = max(counts) > 1
    for i in range(min(counts)):
        entries = [d["optimizers"][i] for d in everyone]
        name = entries[0][0]
        where = f"optimizers[{i}] ({name})" if several else name
        _compare(found, f"{where}: its class", [(e[0], e[0]) for e in entries])
        sizes = [len(e[1]) for e in entries]
        _compare(found, f"{where}: its number of param groups", [(str(n),) * 2 for n in sizes])
        for j in range(min(sizes)):
            groups = [e[1][j] for e in entries]
            for key in sorted({k for g in groups for k in g}):
                values = [g.get(key, ("absent", "absent")) for g in groups]
                _compare(found, f"{where} param_groups[{j}][{key!r}]", values)
    return found


def _compare(found: list, where: str, values: list[tuple[str, str]]) -> None:
    """Append ``(where, {rank: shown})`` when the ranks' exact texts differ; values that show
    alike but differ get their exact text too."""
    exact = {e for e, _ in values}
    if len(exact) > 1:
        alike = len({s for _, s in values}) < len(exact)
        found.append((where, {r: f"{s} ({e})" if alike else s for r, (e, s) in enumerate(values)}))


def _by_rank(values: dict[int, str]) -> str:
    """``"0.1 on ranks [1]; 0.01 on ranks [0, 2, 3]"``: each value once, the ranks holding it."""
    ranks_of: dict[str, list[int]] = {}
    for rank, value in values.items():
        ranks_of.setdefault(value, []).append(rank)
    return "; ".join(f"{v} on ranks {rs}" for v, rs in ranks_of.items())
