"""One all-to-all of byte messages over a group, counted, with a status word per message.

Every message starts with the sender's int64 status (0: fine; else the sender failed locally and
the payload is filler), so a rank that fails before the exchange still takes part in it and its
peers learn of it instead of waiting. ``TRAFFIC`` counts the bytes sent to and received from
other ranks, per direction name.

Three ways to send: ``exchange`` / ``Outbox.send`` read the received status words on the host
(the host-synced step); ``exchange_on_device`` / ``Outbox.send_on_device`` write this rank's
status word from a ``DeviceVerdict`` and fold the received ones into it, on the device, with
positions cached per plan (no host read, nothing copied to the device at a steady step: what a
CUDA graph can capture); ``exchange_records_hosted`` sends the headers and status words through
a host-side group (``comm.host_group_of``) and only the tensors' bytes through the device group.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..._infra.agreement import Wording
from ..._infra.comm import all_to_all_objects, collective_device, uploaded
from ._plan import STATUS_BYTES
from ._verdict import DeviceVerdict

__all__ = [
    "STATUS_BYTES",
    "TRAFFIC",
    "WORDING",
    "Outbox",
    "Part",
    "exchange",
    "exchange_on_device",
    "exchange_records",
    "exchange_records_hosted",
    "part_bytes",
    "view_as",
]


WORDING = Wording("the whole-param optimizer step", "whole-param exchange group")

# (direction, "sent" | "received") -> bytes this process exchanged with other ranks
TRAFFIC: defaultdict[tuple[str, str], int] = defaultdict(int)


Part = torch.Tensor | tuple[torch.Tensor, torch.dtype]  # values, or (values, dtype they travel as)


def part_bytes(part: Part) -> int:
    """Bytes ``part`` takes in a message."""
    if isinstance(part, tuple):
        values, dtype = part
        return values.numel() * dtype.itemsize
    return part.numel() * part.element_size()


class Outbox:
    """One all-to-all's send buffer, ``[status word][payload]`` per peer (none to this rank),
    allocated once and written in place: ``put`` copies a part (any dtype, any layout, cast on
    the way where asked) straight into its place, so a message costs one copy of each part."""

    def __init__(self, payload_sizes: Sequence[int], rank: int, device: torch.device) -> None:
        self.rank = rank
        self.sizes = [0 if r == rank else STATUS_BYTES + n for r, n in enumerate(payload_sizes)]
        self.starts = [0] * len(self.sizes)
        for r in range(1, len(self.sizes)):
            self.starts[r] = self.starts[r - 1] + self.sizes[r - 1]
        self.buf = torch.empty(sum(self.sizes), dtype=torch.uint8, device=device)

    def put(self, peer: int, offset: int, part: Part) -> int:
        """Write ``part`` at byte ``offset`` of ``peer``'s payload; returns the offset after it."""
        values, dtype = part if isinstance(part, tuple) else (part, part.dtype)
        n = part_bytes(part)
        at = self.starts[peer] + STATUS_BYTES + offset
        dst = self.buf[at : at + n]
        if at % dtype.itemsize == 0:
            dst.view(dtype).view(values.shape).copy_(values)
        else:  # unaligned for dtype: through a contiguous copy
            dst.copy_(values.to(dtype).contiguous().view(-1).view(torch.uint8))
        return offset + n

    def zero(self, peer: int, offset: int, nbytes: int) -> None:
        at = self.starts[peer] + STATUS_BYTES + offset
        self.buf[at : at + nbytes].zero_()

    def send(
        self,
        direction: str,
        recv_sizes: Sequence[int],
        status: int,
        group: dist.ProcessGroup | None,
        heads: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Write every peer's status word (and ``heads[r]``, a CPU uint8 tensor, right after
        it) with one indexed copy, then the all-to-all: receive ``recv_sizes[r]`` payload bytes
        (status excluded) from each peer. Returns each peer's payload and status."""
        peers = [r for r, n in enumerate(self.sizes) if n]
        if peers:
            word = torch.tensor([status], dtype=torch.int64).view(torch.uint8)
            values, lengths = [], []
            for r in peers:
                head = heads[r] if heads is not None else None
                values.append(word)
                if head is not None and head.numel():
                    values.append(head)
                lengths.append(STATUS_BYTES + (head.numel() if head is not None else 0))
            counts = torch.tensor(lengths)
            firsts = torch.tensor([self.starts[r] for r in peers])
            # byte positions: each peer's status word, then its head, in one index
            before = torch.cumsum(counts, 0) - counts
            step = torch.arange(int(counts.sum())) - before.repeat_interleave(counts)
            index = firsts.repeat_interleave(counts) + step
            device = self.buf.device
            self.buf[index.to(device)] = torch.cat(values).to(device)
        return _all_to_all(direction, self.buf, self.sizes, recv_sizes, group)

    def send_on_device(
        self,
        direction: str,
        recv_sizes: Sequence[int],
        verdict: DeviceVerdict,
        group: dist.ProcessGroup | None,
        cache: dict,
        heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``send`` without a host read: every peer's status word is ``verdict.word()``
        written on the device, ``heads`` (device positions and bytes, made once per pattern by
        the caller) after it, and the received status words are folded into ``verdict``.
        ``cache`` (the plan's) keeps the words' positions per direction. Returns each peer's
        payload (status excluded)."""
        send_at, recv_at = _word_positions(
            cache, direction, self.rank, self.sizes, recv_sizes, self.buf.device
        )
        if send_at.numel():
            word = verdict.word().view(torch.uint8)
            self.buf.index_copy_(0, send_at, word.repeat(send_at.numel() // STATUS_BYTES))
        if heads is not None and heads[0].numel():
            self.buf.index_copy_(0, heads[0], heads[1])
        recv, parts, _ = _all_to_all_raw(direction, self.buf, self.sizes, recv_sizes, group)
        if recv_at.numel():
            words = view_as(recv.index_select(0, recv_at), torch.int64, (-1,))
            verdict.fold((words != 0).any())
        return parts


def _word_positions(
    cache: dict,
    direction: str,
    rank: int,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte positions of every peer's status word in the send buffer and in the receive
    buffer, as device index tensors, made once per direction and sizes (kept in ``cache``)."""
    key = ("words", direction)
    sizes = (tuple(send_sizes), tuple(recv_sizes))
    cached = cache.get(key)
    if cached is None or cached[0] != sizes:
        out_sizes = [0 if r == rank else STATUS_BYTES + n for r, n in enumerate(recv_sizes)]
        indices = []
        for lengths in (send_sizes, out_sizes):
            at = 0
            positions: list[int] = []
            for n in lengths:
                if n:
                    positions.extend(range(at, at + STATUS_BYTES))
                at += n
            indices.append(uploaded(device, positions, torch.int64))
        cached = cache[key] = (sizes, indices[0], indices[1])
    return cached[1], cached[2]


def _all_to_all_raw(
    direction: str,
    send: torch.Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """The all-to-all itself: the receive buffer, each peer's payload (status excluded) and the
    received message sizes (status included; 0 for this rank)."""
    rank = dist.get_rank(group)
    out_sizes = [0 if r == rank else STATUS_BYTES + n for r, n in enumerate(recv_sizes)]
    recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=send.device)
    if len(out_sizes) > 1:  # a group of one rank has no peer: nothing to exchange
        dist.all_to_all_single(recv, send, out_sizes, list(send_sizes), group=group)
    TRAFFIC[(direction, "sent")] += sum(send_sizes)
    TRAFFIC[(direction, "received")] += sum(out_sizes)
    pieces = recv.split(out_sizes)
    parts_out = [
        piece[STATUS_BYTES:] if n else piece for piece, n in zip(pieces, out_sizes, strict=True)
    ]
    return recv, parts_out, out_sizes


def _all_to_all(
    direction: str,
    send: torch.Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor], list[int]]:
    recv, parts_out, out_sizes = _all_to_all_raw(direction, send, send_sizes, recv_sizes, group)
    pieces = recv.split(out_sizes)
    words = [piece[:STATUS_BYTES] for piece, n in zip(pieces, out_sizes, strict=True) if n]
    # every peer's status word in ONE host read (not one per peer)
    read = view_as(torch.cat(words).cpu(), torch.int64, (-1,)).tolist() if words else []
    statuses = [int(read.pop(0)) if n else 0 for n in out_sizes]
    return parts_out, statuses


def _outbox_of(payloads: Sequence[Sequence[Part]], group: dist.ProcessGroup | None) -> Outbox:
    """An ``Outbox`` holding ``payloads[r]`` for each peer ``r`` (nothing for this rank), each
    part copied once into the send buffer."""
    rank = dist.get_rank(group)
    sizes = [0 if r == rank else sum(map(part_bytes, parts)) for r, parts in enumerate(payloads)]
    box = Outbox(sizes, rank, collective_device(group))
    for r, parts in enumerate(payloads):
        if r == rank:
            continue
        offset = 0
        for part in parts:
            offset = box.put(r, offset, part)
    return box


def exchange(
    direction: str,
    payloads: Sequence[Sequence[Part]],
    recv_sizes: Sequence[int],
    status: int,
    group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor], list[int]]:
    """Send ``payloads[r]`` (parts of any dtype and layout, their bytes one after another) to
    rank ``r``, status word first; receive ``recv_sizes[r]`` payload bytes (status excluded)
    from each. Nothing goes to or comes from this rank itself. Returns each peer's payload and
    status. Each part is copied once, into the send buffer."""
    return _outbox_of(payloads, group).send(direction, recv_sizes, status, group)


def exchange_on_device(
    direction: str,
    payloads: Sequence[Sequence[Part]],
    recv_sizes: Sequence[int],
    verdict: DeviceVerdict,
    group: dist.ProcessGroup | None,
    cache: dict,
) -> list[torch.Tensor]:
    """``exchange`` without a host read (``Outbox.send_on_device``): the status words come from
    and go into ``verdict``. Every part must already be on the group's device (a host part
    would be a host-to-device copy)."""
    return _outbox_of(payloads, group).send_on_device(direction, recv_sizes, verdict, group, cache)


def exchange_records(
    direction: str,
    records: Sequence[tuple[object, Sequence[torch.Tensor]]],
    status: int,
    group: dist.ProcessGroup | None,
) -> tuple[list[tuple[object, torch.Tensor]], list[int], BaseException | None]:
    """Send rank ``r`` the picklable header ``records[r][0]`` and the tensors' bytes
    ``records[r][1]``: a sizes all-to-all (one int64 per peer), then ``exchange``. Returns each
    peer's (header, payload bytes) and status, and the error that packing this rank's records
    raised (a header that does not pickle, say): this rank then still takes part, sending empty
    payloads and a failed status, and the caller raises after its last exchange
    (``Attempt.settle``).
    Only for data of this job's own ranks (pickle)."""
    rank = dist.get_rank(group)
    device = collective_device(group)
    error: BaseException | None = None
    try:
        payloads = _packed(records, rank)
    except Exception as exc:  # still takes part in both all-to-alls
        error, status = exc, status or 1
        payloads = [[] for _ in records]
    sizes = torch.tensor([sum(p.numel() for p in parts) for parts in payloads], dtype=torch.int64)
    got = torch.empty_like(sizes, device=device)
    dist.all_to_all_single(got, sizes.to(device), group=group)
    TRAFFIC[(direction + "_sizes", "sent")] += 8 * (len(sizes) - 1)
    TRAFFIC[(direction + "_sizes", "received")] += 8 * (len(sizes) - 1)
    received, statuses = exchange(direction, payloads, got.tolist(), status, group)
    out: list[tuple[object, torch.Tensor]] = []
    for r, raw in enumerate(received):
        if r == rank or raw.numel() == 0:
            out.append((None, raw))
            continue
        n = int(view_as(raw[:8].cpu(), torch.int64, (1,))[0])
        header = pickle.loads(bytes(raw[8 : 8 + n].cpu().tolist())) if n else None
        out.append((header, raw[8 + n :]))
    return out, statuses, error


def exchange_records_hosted(
    direction: str,
    records: Sequence[tuple[object, Sequence[torch.Tensor]]],
    status: int,
    group: dist.ProcessGroup | None,
    host: dist.ProcessGroup | None,
) -> tuple[list[tuple[object, torch.Tensor]], list[int], BaseException | None]:
    """``exchange_records`` with the headers, status words and sizes sent through ``host`` (a
    host-side group of the same ranks: ``comm.host_group_of``), so nothing is read back from
    the device: ONE object all-to-all on the host, then, only when every rank's status is 0
    (which every rank then knows alike), ONE all-to-all of the tensors' bytes over ``group``.
    Returns what ``exchange_records`` returns; a peer's payload is empty when the bytes were not
    exchanged."""
    rank = dist.get_rank(group)
    device = collective_device(group)
    error: BaseException | None = None
    try:
        payloads = [
            [] if r == rank else [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
            for r, (_, tensors) in enumerate(records)
        ]
        heads = [
            (status, header, sum(p.numel() for p in parts))
            for (header, _), parts in zip(records, payloads, strict=True)
        ]
        got = all_to_all_objects(heads, host)
    except Exception as exc:  # a header that does not pickle: still takes part, failed
        error, status = exc, status or 1
        payloads = [[] for _ in records]
        got = all_to_all_objects([(status, None, 0)] * len(records), host)
    statuses = [0 if g is None else int(g[0]) for g in got]
    recv_sizes = [0 if g is None else int(g[2]) for g in got]
    failed = error is not None or status != 0 or any(statuses)  # the same on every rank
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    if failed:
        return [(None if g is None else g[1], empty) for g in got], statuses, error
    received = _bytes_all_to_all(direction, payloads, recv_sizes, group, device)
    out = [(None if g is None else g[1], raw) for g, raw in zip(got, received, strict=True)]
    return out, statuses, error


def _bytes_all_to_all(
    direction: str,
    payloads: Sequence[Sequence[torch.Tensor]],
    recv_sizes: Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each peer's bytes (``payloads[r]``, uint8 parts) sent, ``recv_sizes[r]`` received: one
    all-to-all, no status words, counted in ``TRAFFIC``."""
    sizes = [sum(p.numel() for p in parts) for parts in payloads]
    send = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    at = 0
    for parts in payloads:
        for part in parts:
            send[at : at + part.numel()].copy_(part)
            at += part.numel()
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    if len(sizes) > 1:
        dist.all_to_all_single(recv, send, list(recv_sizes), sizes, group=group)
    TRAFFIC[(direction, "sent")] += sum(sizes)
    TRAFFIC[(direction, "received")] += sum(recv_sizes)
    return list(recv.split(list(recv_sizes)))


def _packed(
    records: Sequence[tuple[object, Sequence[torch.Tensor]]], rank: int
) -> list[list[torch.Tensor]]:
    """Each peer's message parts: the header's length and pickle, then the tensors' bytes."""
    payloads: list[list[torch.Tensor]] = []
    for r, (header, tensors) in enumerate(records):
        if r == rank:
            payloads.append([])
            continue
        blob = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
        body = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else head[:0]
        payloads.append([head, body, *(t.contiguous().view(-1).view(torch.uint8) for t in tensors)])
    return payloads


def view_as(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Bytes ``raw`` as a ``dtype`` tensor of ``shape`` (copied when misaligned for ``dtype``)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype).view(shape)
