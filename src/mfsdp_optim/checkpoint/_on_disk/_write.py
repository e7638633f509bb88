"""Writing a checkpoint's files: each rank plans and writes its own items, and rank 0 writes DCP's
``.metadata`` from every rank's report, without DCP's planning collectives.

Map: ``plain_writers`` (which rank writes each plain tensor or object: the same answer on every
rank, from the signatures the ranks agreed on); ``write_files`` (this rank's items: the local plan
of DCP's ``DefaultSavePlanner``, the copies of a chunk other ranks also hold left to one of them,
the storage writer's ``write_data``); ``write_metadata`` (rank 0: the ``Metadata`` DCP's global
plan makes, written by the storage writer's ``finish``).

Why: ``dcp.save`` gathers every rank's plan to rank 0 (a pickle of every write item), scatters
the plans back and gathers the write results, three collectives of per-item objects. Here
``save_checkpoint``'s agreement fixes beforehand who writes what, and its one report gather (plain
tuples) carries what rank 0 needs for ``.metadata``. The files and ``.metadata`` are DCP's:
``dcp.load`` and torch's readers read them as any DCP checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["Written", "plain_writers", "write_files", "write_metadata"]


class Written(NamedTuple):
    """What one rank wrote, as it travels in the report gather: per item ``(fqn, offsets, sizes,
    storage data, bytes)`` (``offsets``/``sizes`` None for a non-tensor item); per tensor fqn
    ``(global size, dtype, requires_grad, pin_memory)``; the planner's flatten mapping of the
    fqns (rank 0's covers every key when every rank saves the same keys; otherwise each rank
    sends the entries of the keys it wrote)."""

    items: list[tuple]
    tensors: dict[str, tuple]
    mappings: dict[str, Any] | None


def _size_of(sig: tuple) -> int:
    if sig[0] == "tensor":
        numel = 1
        for n in sig[1]:
            numel *= n
        return numel * torch.empty((), dtype=getattr(torch, sig[2].split(".")[-1])).element_size()
    return 1


def plain_writers(holders: Mapping[str, tuple[tuple, list[int]]]) -> dict[str, int]:
    """The rank (of the group) that writes each plain tensor or object: ``holders`` maps its flat
    key to (its signature, the group ranks that have it); keys in sorted order, each to the
    holder with the fewest bytes so far (ties: the lowest rank), as DCP's deduplication balances
    them. Every rank computes it from the same agreed signatures, so all get the same answer."""
    load: dict[int, int] = {}
    out: dict[str, int] = {}
    for key in sorted(holders):
        sig, ranks = holders[key]
        if sig[0] == "dtensor":
            continue
        pick = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[pick] = load.get(pick, 0) + _size_of(sig)
        out[key] = pick
    return out


def _chunk_holders(tensor: Any, members: frozenset[int]) -> list[int]:
    """The global ranks of the saving group that hold the same chunk of ``tensor`` (a DTensor)
    as this rank: those whose mesh coordinate matches on every sharded mesh dimension (any
    coordinate, when this rank's chunk is empty: empty chunks share one offset)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    shape, placements = tuple(tensor.shape), tuple(tensor.placements)
    sizes, mine = _compute_local_shape_and_global_offset(shape, mesh.shape, coord, placements)
    grid = mesh.mesh
    if all(n > 0 for n in sizes):
        sharded = {d for d, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard))}
        at = tuple(coord[d] if d in sharded else slice(None) for d in range(grid.dim()))
        ranks = grid[at].flatten().tolist()
    else:
        ranks = [
            int(grid[c])
            for c in itertools.product(*(range(n) for n in mesh.shape))
            if _compute_local_shape_and_global_offset(shape, mesh.shape, list(c), placements)[1]
            == mine
        ]
    return sorted(r for r in ranks if r in members)


def write_files(
    state_dict: Mapping[str, Any],
    writer: Any,
    rank: int,
    global_rank: int,
    members: frozenset[int],
    plain: Mapping[str, int],
    send_mappings: bool,
) -> Written:
    """Plan and write this rank's items of ``state_dict`` with ``writer`` (a DCP
    ``FileSystemWriter``) into its files ``__<rank>_*.distcp``.

    A DTensor chunk that several ranks hold (a replicated mesh dimension) is written by one of
    them, picked from its key (spreads the writes; every holder picks the same); a plain tensor
    or object by ``plain[key]``. ``rank`` is this rank's index in the group, ``global_rank`` its
    global rank, ``members`` the group's global ranks."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    planner = DefaultSavePlanner()
    planner.set_up_planner(dict(state_dict), writer.storage_meta(), rank == 0)
    if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    else:
        writer.set_up_storage_writer(rank == 0)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    keep = _mine(plan.items, planner.state_dict, rank, global_rank, members, plain)
    plan = dataclasses.replace(plan, items=keep, storage_data=_StoragePrefix(f"__{rank}_"))
    plan = planner.finish_plan(plan)
    results = writer.write_data(plan, planner).wait()
    return _written(plan.items, results, planner.mappings, rank, send_mappings)


def _mine(
    items: list,
    flat: Mapping[str, Any],
    rank: int,
    global_rank: int,
    members: frozenset[int],
    plain: Mapping[str, int],
) -> list:
    """The write items of the local plan this rank writes: a DTensor chunk held by several
    ranks by the one its key picks, a plain item by ``plain[key]``."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.tensor import DTensor

    decided: dict[tuple, list[int]] = {}
    keep = []
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.SHARD:
            value = flat[fqn]
            if not isinstance(value, DTensor):  # a ShardedTensor: its shards are its own
                keep.append(item)
                continue
            key = (id(value.device_mesh), tuple(value.placements), tuple(value.shape))
            ranks = decided.get(key)
            if ranks is None:
                ranks = decided[key] = _chunk_holders(value, members)
            if len(ranks) <= 1 or ranks[zlib.crc32(fqn.encode()) % len(ranks)] == global_rank:
                keep.append(item)
        elif fqn not in plain:
            raise RuntimeError(f"{fqn!r}: no rank was chosen to write this item (a bug)")
        elif plain[fqn] == rank:
            keep.append(item)
    return keep


def _written(
    planned: list, results: list, all_mappings: Mapping[str, Any], rank: int, send_mappings: bool
) -> Written:
    """This rank's report of what it wrote, in the plan's order (the state dict's), not the
    writer's: FileSystemWriter reports its results sorted by size where CUDA is available, and
    in completion order over several threads; ``.metadata`` lists keys in this order, and
    readers show it (the CLI, in model order)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    result_of = {res.index: res for res in results}
    items: list[tuple] = []
    tensors: dict[str, tuple] = {}
    for item in planned:
        res = result_of[item.index]
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            items.append((fqn, None, None, res.storage_data, res.size_in_bytes))
            continue
        data = item.tensor_data
        chunk = data.chunk
        items.append(
            (fqn, tuple(chunk.offsets), tuple(chunk.sizes), res.storage_data, res.size_in_bytes)
        )
        if fqn not in tensors:
            p = data.properties
            tensors[fqn] = (tuple(data.size), p.dtype, p.requires_grad, p.pin_memory)
    mappings: dict[str, Any] | None = None
    if rank == 0:
        mappings = dict(all_mappings)
    elif send_mappings:
        mappings = {k: all_mappings[k] for k in {it[0] for it in items}}
    return Written(items, tensors, mappings)


def write_metadata(writer: Any, written: list[Written]) -> None:
    """Rank 0: DCP's ``.metadata`` for every rank's ``written`` items (keys in the order of the
    ranks' plans, chunks in rank order, as DCP's global plan lists them), through
    ``writer.finish``."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    md: dict[str, Any] = {}
    results = []
    mappings: dict[str, Any] = {}
    for w in written:
        if w.mappings:
            mappings.update(w.mappings)
        for fqn, offsets, sizes, info, nbytes in w.items:
            if sizes is None:
                md[fqn] = BytesStorageMetadata()
                results.append(WriteResult(MetadataIndex(fqn), nbytes, info))
                continue
            tmd = md.get(fqn)
            if tmd is None:
                size, dtype, grad, pinned = w.tensors[fqn]
                props = TensorProperties(dtype=dtype, requires_grad=grad, pin_memory=pinned)
                tmd = md[fqn] = TensorStorageMetadata(props, torch.Size(size), [])
            index = MetadataIndex(fqn, offsets, len(tmd.chunks))
            tmd.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            results.append(WriteResult(index, nbytes, info))
    writer.finish(Metadata(md, planner_data=mappings), [results])
