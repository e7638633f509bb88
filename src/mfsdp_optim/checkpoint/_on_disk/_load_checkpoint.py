"""``load_checkpoint``, the staged load: the load target checked against the checkpoint, then
loaded into copies swapped in only once every rank loaded.

Map: ``load_checkpoint`` runs its phases in order: ``_check`` (this rank alone: the checkpoint
whole, the target in its ``.metadata``), ``_agree_to_load`` (the rank agreement), under
``strict`` ``_refuse_unexpected``, ``_load_and_swap_in`` (``dcp.load`` into copies, every rank
loaded, ``swap_in``). The checks: ``check_chunks`` (the chunks ``.metadata`` lists for each
tensor to load tile its global shape exactly); ``check_targets`` (every key of the target in the
checkpoint's metadata, with its global shape and dtype; ``_layout_hint`` for a
``param_to_group_meta`` in another layout); ``unexpected`` (checkpoint keys the ranks' targets
together lack inside a section they load); ``clone`` (the staging copy DCP loads into) and
``swap_in`` (the copy written into the live target, tensors in place, once every rank loaded).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..._infra.agreement import Failure
from ..._infra.attempt import Attempt
from ..._infra.host import paused_gc
from . import _async
from ._check_checkpoint import check_checkpoint, resolve
from ._consensus import (
    agree_on_directory,
    agreed,
    check_agreement,
    check_uniform,
    dist_info,
    flat,
    group_ranks,
    raise_agreed,
    sig_digest,
    signatures,
)
from ._safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    raise_unsafe,
    safe_read_metadata,
)

__all__ = ["check_chunks", "check_targets", "clone", "load_checkpoint", "swap_in", "unexpected"]


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

    from ..._infra.placement import copy_in_layout

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


@paused_gc()
def load_checkpoint(
    state_dict: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    verify_checksums: bool = True,
    require_marker: bool = True,
    process_group: dist.ProcessGroup | None = None,
    planner: Any = None,
    strict: bool = True,
    in_place: bool = False,
) -> dict:
    """``dcp.load`` into ``state_dict``, all or nothing, after proving the checkpoint whole.

    Every rank of ``process_group`` calls it, with the same ``directory``. Before DCP reads
    anything: ``check_checkpoint()`` (completeness, file sizes, ``.metadata`` hash, the CRC32
    of every item, tensor and non-tensor, the reads split over the ranks), the ``.metadata``
    unpickled with an allow-list, every key of ``state_dict`` present with its global shape and
    dtype, and, with ``strict=True``, no checkpoint key the ranks' targets together lack inside
    a section they load (``optimizer.state.<fqn>.max_exp_avg_sq`` saved with ``amsgrad=True``,
    loaded into ``amsgrad=False``: the optimizer would step with half its state). ONE
    ``all_gather_object`` shares every rank's findings and directory; if any rank found anything,
    every rank raises and nothing changed.

    Then ``dcp.load`` with ``SafeFileSystemReader`` and ``SafeLoadPlanner`` into
    staging copies of ``state_dict``'s tensors; one more small collective agrees that every rank
    loaded, and only then are the copies written into ``state_dict`` (tensors in place, so the
    live optimizer state it shares storage with changes at that moment, on every rank or on
    none).

    Args:
        state_dict: The load target, for example ``{"optimizer":
            opt.sharded_state_dict(is_loading=True), ...}``; filled in place.
        directory: The checkpoint directory; the same path on every rank.
        verify_checksums: Recompute the CRC32 of every item the save recorded (the reads
            split over the ranks).
        require_marker: Refuse a plain DCP checkpoint without this package's completion
            marker (``False`` loads it, its integrity then resting on DCP alone).
        process_group: The ranks that load (default WORLD); every rank of it must call.
        planner: The DCP load planner (default: ``SafeLoadPlanner``, which loads non-tensor
            items with ``weights_only=True``).
        strict: Refuse a checkpoint holding keys the ranks' targets together lack inside a
            section they load; False leaves those entries out.
        in_place: Skip the staging copies (half the peak memory; a failure inside DCP then
            leaves the state partly overwritten, everything verifiable having been verified
            before).

    Returns:
        The checkpoint's completion marker (``{}`` for a plain DCP checkpoint loaded with
            ``require_marker=False``).

    Raises:
        IncompleteCheckpointError: On every rank, nothing changed: the save never finished
            (or a plain DCP checkpoint with ``require_marker=True``).
        CorruptCheckpointError: On every rank, nothing changed: missing, truncated or replaced
            files, a ``.metadata`` from another run, a checksum mismatch, chunks in
            ``.metadata`` that do not tile a target tensor's global shape.
        FileNotFoundError: On every rank, nothing changed: no checkpoint there.
        StateDictMismatchError: On every rank, nothing changed: a target key missing from the
            checkpoint or with another global shape or dtype, or (``strict=True``) checkpoint
            keys the targets lack.
        RankDisagreementError: On every rank, nothing changed: the ranks passed different
            ``directory`` paths or targets that do not fit together.
        UnsafeCheckpointError: On every rank: ``.metadata`` or a non-tensor item asks the
            unpickler for something outside the allow-list.
        RuntimeError: ``dcp.load`` failed on some rank (nothing was loaded, or with
            ``in_place=True`` the state is partly loaded), a checkpoint collective failed or
            timed out, or (on every rank, nothing loaded) an asynchronous save failed and its
            handle's ``wait()`` never raised it. An asynchronous save in flight is waited for
            first.
    """
    rank, world, _ = dist_info(process_group)
    given = os.path.abspath(os.fspath(directory))
    attempt = Attempt(_async.settle())  # a save in flight: wait; its unreported error
    path = resolve(given)
    checked = _check(
        state_dict, given, path, (rank, world), verify_checksums, require_marker, attempt
    )
    sigs = _agree_to_load(attempt, checked, given, path, process_group, world)
    if strict:  # the same file and the same targets on every rank: the same verdict
        _refuse_unexpected(checked.ckpt_keys, sigs, path)
    _load_and_swap_in(state_dict, path, checked.metadata, planner, process_group, in_place)
    return checked.marker


class _Checked(NamedTuple):
    """What this rank found before the agreement (each field as far as it got)."""

    marker: dict  # the completion marker
    metadata: Any  # the checkpoint's ``.metadata``, read once
    sig: dict  # the target's signatures
    digest: list[int]  # their digest ([] when they could not be computed)
    ckpt_keys: list[str]  # the checkpoint's keys


def _check(
    state_dict: Mapping[str, Any],
    given: str,
    path: str,
    part: tuple[int, int],
    verify_checksums: bool,
    require_marker: bool,
    attempt: Attempt,
) -> _Checked:
    """Phase 1, this rank alone, no collective: the checkpoint proven whole (``check_checkpoint``,
    the reads split over the ranks by ``part``), its ``.metadata`` read, the target's keys,
    shapes and dtypes in it, its chunks tiling each target tensor. Every error, found or raised,
    goes to ``attempt`` (the first one kept), so this rank still enters the agreement."""
    marker: dict = {}
    metadata: Any = None
    sig: dict = {}
    digest: list[int] = []
    ckpt_keys: list[str] = []
    try:
        target_flat = flat(state_dict)
        sig = signatures(state_dict, values=False)
        digest = sig_digest(sig, given)
        marker = check_checkpoint(
            given, verify_checksums=verify_checksums, require_marker=require_marker, _part=part
        )
        metadata = safe_read_metadata(path)  # once: the checks here and dcp.load's reader
        errors, ckpt_keys = check_targets(path, target_flat, metadata)
        if errors:
            attempt.fail(Failure("StateDictMismatchError", ("\n  ".join(errors),)))
        torn = check_chunks(target_flat, metadata)
        if torn:
            attempt.fail(Failure("CorruptCheckpointError", (f"{path}:", *torn)))
    except Exception as exc:
        attempt.fail(exc)
    return _Checked(marker, metadata, sig, digest, ckpt_keys)


def _agree_to_load(
    attempt: Attempt,
    checked: _Checked,
    given: str,
    path: str,
    group: dist.ProcessGroup | None,
    world: int,
) -> list[dict]:
    """Phase 2, the rank agreement: ONE all-reduce of the digests; every rank's findings,
    signatures and directory only when some rank found something or the digests differ. Raises
    on every rank alike when a rank failed, the directories differ or the targets do not fit
    together; returns the signatures of every rank's target (this rank's alone when the digests
    agreed)."""
    verdict = agreed(attempt, group, digest=checked.digest or [-1, -1], detail=(checked.sig, given))
    if not verdict.same:
        assert verdict.details is not None
        agree_on_directory([d[1] for d in verdict.details], "load from", "nothing was loaded")
    raise_agreed(verdict, f"refusing to load {path} (nothing was loaded)")
    ranks = group_ranks(group, world)
    if verdict.same:
        sigs = [checked.sig]
        errors = check_uniform(checked.sig, ranks)
    else:
        assert verdict.details is not None
        sigs = [d[0] for d in verdict.details]
        errors = check_agreement(sigs, ranks)
    if errors:
        raise_agreed(
            {0: Failure("RankDisagreementError", ("\n  ".join(errors[:30]),))},
            f"ranks disagree on the state dict to load from {path} (nothing loaded)",
        )
    return sigs


def _refuse_unexpected(ckpt_keys: list[str], sigs: list[dict], path: str) -> None:
    """``strict=True``: raise on every rank when the checkpoint holds keys the ranks' targets
    together lack inside a section they load (every rank computes it from the same data)."""
    extra = unexpected(ckpt_keys, {k for s in sigs for k in s})
    if extra:
        raise_agreed(
            {
                0: Failure(
                    "StateDictMismatchError",
                    (
                        f"the checkpoint holds {len(extra)} key(s) the target lacks, "
                        f"e.g. {extra[:5]}: it was saved by an optimizer with other options "
                        "(for example amsgrad=True, loaded into amsgrad=False, which would "
                        "step without max_exp_avg_sq) or by another model. Build the "
                        "optimizer and model with the options of the save, or pass "
                        "strict=False to leave those entries out",
                    ),
                )
            },
            f"refusing to load {path} (nothing was loaded)",
        )


def _load_and_swap_in(
    state_dict: Mapping[str, Any],
    path: str,
    metadata: Any,
    planner: Any,
    group: dist.ProcessGroup | None,
    in_place: bool,
) -> None:
    """Phase 3: ``dcp.load`` into staging copies (or, ``in_place``, the target itself), ONE
    all-reduce that every rank loaded, and only then the copies swapped into ``state_dict``."""
    import torch.distributed.checkpoint as dcp

    target = state_dict if in_place else clone(state_dict)
    attempt = Attempt()
    try:
        # DCP's default load plan is made by each rank alone (its central step changes
        # nothing); with our planner every rank reads on its own, without DCP's plan gather and
        # scatter (pickles of every read item) and read gather: the agreements before and after
        # stand in for them. A planner of yours gets DCP's collectives.
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(path, metadata=metadata),
            planner=planner if planner is not None else SafeLoadPlanner(),
            process_group=group,
            no_dist=planner is None or type(planner) is SafeLoadPlanner,
        )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        attempt.fail(_load_failure(exc))
    state = "partly loaded (in_place=True)" if in_place else "nothing was loaded"
    raise_agreed(agreed(attempt, group), f"loading {path} failed ({state})")
    if not in_place:
        swap_in(state_dict, target)


def _load_failure(exc: BaseException) -> Failure:
    """What ``dcp.load``'s ``exc`` is reported as: ``UnsafeCheckpointError`` where the
    unpickler refused an item, else a ``RuntimeError`` naming it."""
    try:
        raise_unsafe(exc)
    except UnsafeCheckpointError as unsafe:
        return Failure(type(unsafe).__name__, (str(unsafe),))
    return Failure("RuntimeError", (f"dcp.load failed: {type(exc).__name__}: {str(exc)[:2000]}",))
