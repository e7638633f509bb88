"""One all-to-all of byte messages over a group, counted, with a status word per message.

Every message starts with the sender's int64 status (0: fine; else the sender failed locally and
the payload is filler), so a rank that fails before the exchange still takes part in it and its
peers learn of it instead of waiting. ``TRAFFIC`` counts the bytes sent to and received from
other ranks, per direction name.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..._infra.agreement import Wording, agree
from ..._infra.comm import collective_device

__all__ = ["TRAFFIC", "WORDING", "exchange", "exchange_records", "settle", "view_as"]

WORDING = Wording("the whole-param optimizer step", "whole-param exchange group")

# (direction, "sent" | "received") -> bytes this process exchanged with other ranks
TRAFFIC: defaultdict[tuple[str, str], int] = defaultdict(int)


def exchange(
    direction: str,
    payloads: Sequence[Sequence[torch.Tensor]],
    recv_sizes: Sequence[int],
    status: int,
    group: dist.ProcessGroup | None,
) -> tuple[list[torch.Tensor], list[int]]:
    """Send ``payloads[r]`` (uint8 tensors, concatenated) to rank ``r``, status word first;
    receive ``recv_sizes[r]`` payload bytes (status excluded) from each. Nothing goes to or comes
    from this rank itself. Returns each peer's payload and status."""
    rank = dist.get_rank(group)
    device = collective_device(group)
    word = torch.tensor([status], dtype=torch.int64).view(torch.uint8)
    chunks: list[torch.Tensor] = []
    send_sizes = []
    for r, parts in enumerate(payloads):
        if r == rank:
            send_sizes.append(0)
            continue
        chunks.append(word)
        chunks.extend(p.reshape(-1) for p in parts)
        send_sizes.append(8 + sum(p.numel() for p in parts))
    out_sizes = [0 if r == rank else 8 + n for r, n in enumerate(recv_sizes)]
    if chunks:
        send = torch.cat([c.to(device) for c in chunks])
    else:
        send = torch.empty(0, dtype=torch.uint8, device=device)
    recv = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, out_sizes, send_sizes, group=group)
    TRAFFIC[(direction, "sent")] += sum(send_sizes)
    TRAFFIC[(direction, "received")] += sum(out_sizes)
    pieces = recv.split(out_sizes)
    parts_out = [piece[8:] if n else piece for piece, n in zip(pieces, out_sizes, strict=True)]
    words = [piece[:8] for piece, n in zip(pieces, out_sizes, strict=True) if n]
    # every peer's status word in ONE host read (not one per peer)
    read = view_as(torch.cat(words).cpu(), torch.int64, (-1,)).tolist() if words else []
    statuses = [int(read.pop(0)) if n else 0 for n in out_sizes]
    return parts_out, statuses


def exchange_records(
    direction: str,
    records: Sequence[tuple[object, Sequence[torch.Tensor]]],
    status: int,
    group: dist.ProcessGroup | None,
) -> tuple[list[tuple[object, torch.Tensor]], list[int]]:
    """Send rank ``r`` the picklable header ``records[r][0]`` and the tensors' bytes
    ``records[r][1]``: a sizes all-to-all (one int64 per peer), then ``exchange``. Returns each
    peer's (header, payload bytes) and status. Only for data of this job's own ranks (pickle)."""
    rank = dist.get_rank(group)
    device = collective_device(group)
    payloads: list[list[torch.Tensor]] = []
    for r, (header, tensors) in enumerate(records):
        if r == rank:
            payloads.append([])
            continue
        blob = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
        body = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else head[:0]
        payloads.append([head, body, *(t.contiguous().view(-1).view(torch.uint8) for t in tensors)])
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
    return out, statuses


def view_as(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Bytes ``raw`` as a ``dtype`` tensor of ``shape`` (copied when misaligned for ``dtype``)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def settle(
    error: BaseException | None, statuses: Sequence[int], group: dist.ProcessGroup | None
) -> None:
    """After a step's last exchange, before anything is written: when this rank failed
    (``error``) or any status word it received is non-zero, every rank gets here alike and
    issues ONE object gather of every rank's failure (``agreement.agree``); the failing ranks
    raise their own error, the others ``RankFailedError`` naming them. Otherwise nothing."""
    if error is None and not any(statuses):
        return
    verdict = agree(error, group, always=True)
    verdict.raise_own_or_peer(error, WORDING)
    raise RuntimeError(  # a status word without a failure behind it: a bug, never a result
        f"{WORDING.what}: a rank signalled a failure but reported none; nothing was updated"
    )
