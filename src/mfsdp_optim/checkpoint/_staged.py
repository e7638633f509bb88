"""The staged load: the load target checked against the checkpoint, then loaded into copies.

Map: ``check_chunks`` (the chunks ``.metadata`` lists for each tensor to load tile its global
shape exactly); ``check_targets`` (every key of the target in the checkpoint's metadata, with
its global shape and dtype; ``_layout_hint`` for a ``param_to_group_meta`` in another layout);
``unexpected`` (checkpoint keys the ranks' targets together lack inside a section they load);
``clone`` (the staging copy DCP loads into) and ``swap_in`` (the copy written into the live
target, tensors in place, once every rank loaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_chunks", "check_targets", "clone", "swap_in", "unexpected"]


def check_targets(path: str, flat: dict[str, Any], metadata: Any) -> tuple[list[str], list[str]]:
    """Every key of the load target present in the checkpoint (its ``metadata``, read once by
    the caller), with its global shape and dtype; returns the errors and the checkpoint's
    keys."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in md)
    errors = []
    if missing:
        prefixes = sorted({k.split(".")[0] for k in md})
        errors.append(
            f"{path}: the checkpoint has no entries for {len(missing)} of the {len(flat)} keys "
            f"to load, e.g. {missing[:5]} (it holds top-level keys {prefixes[:10]}): a checkpoint "
            "of another model or optimizer, or saved under another prefix"
            + _layout_hint(missing, md)
        )
    for key, value in flat.items():
        item = md.get(key)
        if item is None:
            continue
        if not isinstance(value, torch.Tensor):
            if not isinstance(item, BytesStorageMetadata):
                errors.append(
                    f"{key!r}: the checkpoint holds a tensor {list(item.size)}, the "
                    f"target a {type(value).__name__}"
                )
            continue
        if isinstance(item, BytesStorageMetadata):
            errors.append(f"{key!r}: the checkpoint holds an object, the target a tensor")
            continue
        if tuple(item.size) != tuple(value.shape) or item.properties.dtype != value.dtype:
            errors.append(
                f"{key!r}: the checkpoint holds {list(item.size)} "
                f"{item.properties.dtype}, the target is {list(value.shape)} "
                f"{value.dtype}"
            )
    return errors[:30], sorted(md)


def check_chunks(flat: dict[str, Any], metadata: Any, limit: int = 30) -> list[str]:
    """For every tensor key of the load target, the chunks the checkpoint's ``metadata`` lists
    must tile its global shape exactly: each inside the shape, none overlapping, their volumes
    adding up to the whole. DCP reads only the overlap of each chunk with the target's shard, so
    a chunk whose offset or size was rewritten (a hand-edited ``.metadata`` whose marker and
    checksums were rewritten to match, a faulty writer) would leave part of the target as it
    was, live values beside saved ones, with no error: a factored entry such as Adafactor's
    ``row_var``, one Replicate chunk, would come back as live rows followed by saved rows."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = metadata.state_dict_metadata
    errors: list[str] = []
    for key, value in flat.items():
        item = md.get(key)
        if not isinstance(value, torch.Tensor) or item is None:
            continue
        if isinstance(item, BytesStorageMetadata):
            continue  # check_targets reports it
        problem = _tiling_problem(tuple(item.size), item.chunks)
        if problem:
            errors.append(
                f"{key!r}: the checkpoint's chunks do not tile its global shape "
                f"{list(item.size)}: {problem}. Its .metadata was edited or written by a faulty "
                "writer; loading it would mix saved and live values. Load another checkpoint"
            )
            if len(errors) >= limit:
                break
    return errors


def _tiling_problem(shape: tuple[int, ...], chunks: Any) -> str:
    """Why ``chunks`` (``offsets``, ``sizes``) do not tile ``shape`` exactly, or ``""``."""
    total = 1
    for d in shape:
        total *= d
    boxes = []
    volume = 0
    for c in chunks:
        off, size = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(shape) or len(size) != len(shape):
            return f"a chunk at {list(off)} of size {list(size)} has another number of dims"
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(off, size, shape, strict=True)):
            return f"the chunk at {list(off)} of size {list(size)} reaches outside it"
        n = 1
        for x in size:
            n *= x
        volume += n
        if n:
            boxes.append((off, size))
    if volume != total:
        return f"they hold {volume} elements, the shape {total}"
    if len(shape) == 0:
        return "" if len(boxes) <= 1 else "a scalar saved in more than one chunk"
    # equal volumes: they tile it iff no two overlap (a sweep along dim 0)
    boxes.sort(key=lambda b: b[0][0])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, size in boxes:
        active = [b for b in active if b[0][0] + b[1][0] > off[0]]
        for o2, s2 in active:
            pairs = zip(off, size, o2, s2, strict=True)
            if all(a < b2 + n2 and b2 < a + n for a, n, b2, n2 in pairs):
                return f"the chunks at {list(o2)} and {list(off)} overlap"
        active.append((off, size))
    return ""


def _layout_hint(missing: list[str], md: Mapping) -> str:
    """A hint when the target and the checkpoint hold ``param_to_group_meta`` in different
    layouts (a format-3 target for a format-2 or 0.1.0 checkpoint, or the reverse)."""
    for key in missing:
        head, sep, _ = key.partition(".param_to_group_meta")
        if not sep:
            continue
        table = f"{head}.param_to_group_meta"
        per_fqn = key == table and any(k.startswith(table + ".") for k in md)
        if per_fqn or (key != table and table in md):
            return (
                f". {table!r} is in another layout in the checkpoint (format 3 is one item, "
                "formats 2 and 1 one or more per FQN): pass the target through "
                "prune_to_checkpoint(target, directory) first"
            )
    return ""


def unexpected(ckpt_keys: list[str], target_keys: set[str]) -> list[str]:
    """Checkpoint keys the target (the union over ranks) lacks, under a section it loads: a
    key ``a.b.rest`` counts when the target holds any key under ``a.b`` (``optimizer.state``),
    so loading one section of a bigger checkpoint (the optimizer without the model) stays
    possible, but not half of one (``max_exp_avg_sq`` dropped, or an FQN)."""
    sections = {".".join(k.split(".")[:2]) for k in target_keys}
    return [k for k in ckpt_keys if k not in target_keys and ".".join(k.split(".")[:2]) in sections]


def clone(value: Any) -> Any:
    """A staging copy of a load target: containers copied, tensors cloned, the rest shared."""
    from torch.distributed.tensor import DTensor

    from .._infra.placement import copy_in_layout

    if isinstance(value, DTensor):
        return copy_in_layout(value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


@torch.no_grad()
def swap_in(live: Any, staged: Any) -> None:
    """Write the staged values into the live target the way DCP would have: tensors in place
    (they share storage with the optimizer state), other values replaced in their container."""
    from torch.distributed.tensor import DTensor

    items = live.items() if isinstance(live, Mapping) else enumerate(live)
    for key, old in list(items):
        new = staged[key]
        if isinstance(old, DTensor):
            old._local_tensor.copy_(new._local_tensor)
        elif isinstance(old, torch.Tensor):
            old.copy_(new)
        elif isinstance(old, (Mapping, list)):
            swap_in(old, new)
        elif new is not old:
            live[key] = new
