"""``save_checkpoint`` / ``load_checkpoint``: publish a checkpoint only when every rank finished,
and refuse incomplete, damaged or foreign ones before a single byte reaches the live state.

Map: ``_consensus`` agrees on what every rank saves or loads (ONE all-reduce of a digest; the
detail only when it differs or a rank failed); ``_publish`` stages and publishes atomically;
``_integrity`` checks completeness and checksums; ``_staged`` loads into copies swapped in only
once every rank loaded. Collectives of ``save_checkpoint``: that all-reduce, ``dcp.save``'s own,
one object gather (every rank's writes and checksums), one all-reduce (the publish verdict). Of
``load_checkpoint``: that all-reduce, ``dcp.load``'s own, one all-reduce (every rank loaded).
The on-disk layout and its guarantees: docs/reliability.md.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from .._infra.agreement import Failure, failure_of
from ._consensus import (
    RankDisagreementError,
    agree_on_directory,
    agreed,
    check_agreement,
    check_uniform,
    dist_info,
    flat,
    gather,
    group_ranks,
    raise_agreed,
    sig_digest,
    signatures,
)
from ._integrity import (
    CHECKSUMS_FILE,
    COMPLETE_MARKER,
    STAGING_SUFFIX,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    check_checkpoint,
    checkpoint_status,
    checksum_items,
    item_record,
    resolve,
)
from ._publish import capturing, check_name, publish
from ._safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    raise_unsafe,
    safe_read_metadata,
)
from ._staged import check_targets, clone, swap_in, unexpected

__all__ = [
    "CHECKSUMS_FILE",
    "COMPLETE_MARKER",
    "STAGING_SUFFIX",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "RankDisagreementError",
    "check_checkpoint",
    "checkpoint_status",
    "load_checkpoint",
    "save_checkpoint",
]


def save_checkpoint(
    state_dict: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    checksums: bool = True,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    metadata: Mapping[str, Any] | None = None,
    writer_cls: type = FileSystemWriter,
    thread_count: int = 1,
) -> str:
    """Save ``state_dict`` with ``torch.distributed.checkpoint`` and publish it atomically.

    Every rank of ``process_group`` calls it with its own state dict. First the ranks check,
    with one collective, that they agree on what they save: every DTensor key on exactly the
    ranks of its mesh with one global shape, dtype and layout, and plain tensors / objects equal
    wherever they appear (DCP keeps one copy of those); otherwise nothing is written. DCP then
    writes into ``<directory>.incomplete``; once every rank reports its writes done, rank 0
    writes the CRC32 of every item (``checksums=True``), the completion marker (file sizes,
    SHA-256 of ``.metadata``, ``metadata``) and renames the directory to ``directory``.

    With ``overwrite=True`` the old directory is replaced after the new one is complete, in one
    atomic directory exchange where the OS offers it, so the name always holds a whole
    checkpoint, the old or the new one (the documentation's Reliability page describes the
    fallback). A stale ``<directory>.incomplete`` from a crashed save is deleted first.

    Args:
        state_dict: This rank's state dict, for example ``{"optimizer":
            opt.sharded_state_dict(), "grad_scaler": opt.grad_scaler_state_dict()}``.
        directory: Where the checkpoint is published; the same path on every rank. Names
            ending in ``.incomplete`` or ``.old-<8 hex digits>`` are reserved.
        checksums: Also write the CRC32 of every item DCP wrote (``mfsdp_checksums.json``),
            so a load catches bit flips.
        overwrite: Replace an existing ``directory`` (atomically, once the new one is complete).
        process_group: The ranks that save (default WORLD); every rank of it must call.
        metadata: Any JSON-able dict of yours, stored in the completion marker.
        writer_cls: The DCP storage writer class (a ``FileSystemWriter`` subclass), given to DCP.
        thread_count: The writer's thread count, given to DCP.

    Returns:
        The published checkpoint directory (as an absolute path), on every rank.

    Raises:
        RankDisagreementError: On every rank, nothing written, when the ranks disagree on what
            they save or pass different ``directory`` paths.
        ValueError: On every rank, for a reserved ``directory`` name.
        FileExistsError: On every rank, when ``directory`` exists and ``overwrite`` is False
            (or it exists and is not a directory).
        RuntimeError: ``dcp.save`` failed (a rank probably died or was killed during the
            save: nothing was published, the previous checkpoint is untouched, the partial files
            are in ``<directory>.incomplete``), a checkpoint collective failed or timed out, or
            the checkpoint could not be published.
    """
    rank, world, _ = dist_info(process_group)
    final = os.path.abspath(os.fspath(directory))
    staging = final + STAGING_SUFFIX
    prep: Failure | None = None
    created = False
    try:
        check_name(final)
        if rank == 0:
            if os.path.exists(final) and not overwrite:
                raise FileExistsError(f"{final} already exists; pass overwrite=True to replace it")
            if os.path.exists(final) and not os.path.isdir(final):
                raise FileExistsError(
                    f"{final} exists and is not a directory; remove it or choose another name"
                )
            if os.path.exists(staging):
                shutil.rmtree(staging)  # what a crashed earlier save left behind
            os.makedirs(staging)
            created = True
    except (OSError, ValueError) as exc:
        prep = failure_of(exc)
    sig: dict[str, tuple] = {}
    try:
        sig = signatures(state_dict, values=True)
        digest = sig_digest(sig, final)
    except Exception as exc:  # never leave the others waiting in the collective
        sig, digest, prep = {}, [], prep or failure_of(exc)
    # the rank agreement: ONE all-reduce of the digests; every rank's signatures, failure and
    # directory only when some rank failed or the digests differ
    verdict = agreed(prep, process_group, digest=digest or [-1, -1], detail=(sig, final))
    try:
        raise_agreed(verdict, f"cannot save the checkpoint {final}")
        ranks = group_ranks(process_group, world)
        if verdict.same:
            errors = check_uniform(sig, ranks)
        else:
            assert verdict.details is not None
            agree_on_directory([d[1] for d in verdict.details], "save into", "nothing written")
            errors = check_agreement([d[0] for d in verdict.details], ranks)
        if errors:
            raise_agreed(
                {0: Failure("RankDisagreementError", ("\n  ".join(errors[:30]),))},
                f"ranks disagree on the state dict to save into {final} (nothing written)",
            )
    except BaseException:
        if created:  # rank 0's empty staging directory: leave nothing behind
            shutil.rmtree(staging, ignore_errors=True)
        raise

    import torch.distributed.checkpoint as dcp

    writer = capturing(writer_cls)(staging, thread_count=thread_count)
    t0 = time.perf_counter()
    try:
        dcp.save(dict(state_dict), storage_writer=writer, process_group=process_group)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise RuntimeError(
            f"dcp.save of {final} failed ({type(exc).__name__}: {str(exc)[:2000]}); a rank "
            "probably died or was killed during the save. Nothing was published: the previous "
            f"checkpoint is untouched and the partial files are in {staging}."
        ) from exc
    t_save = time.perf_counter() - t0

    report: tuple[list[dict], tuple[str, str] | None]
    try:
        mine = [item_record(r.index, r.storage_data) for r in getattr(writer, "mfsdp_results", [])]
        report = (checksum_items(staging, mine) if checksums else mine, None)
    except Exception as exc:
        report = ([], (type(exc).__name__, str(exc)))
    t_crc = time.perf_counter() - t0 - t_save
    reports = gather(report, process_group)

    outcome: Failure | None = None
    if rank == 0:
        try:
            failed = [r for r, (_, e) in enumerate(reports) if e is not None]
            if failed:
                raise RuntimeError(
                    f"ranks {failed} could not checksum their files: "
                    f"{[reports[r][1] for r in failed]}"
                )
            publish(
                staging,
                final,
                reports,
                checksums,
                overwrite,
                world,
                metadata,
                {"dcp_save_s": t_save, "checksum_s": t_crc},
            )
        except Exception as exc:
            outcome = failure_of(exc)
    raise_agreed(agreed(outcome, process_group), f"could not publish the checkpoint {final}")
    return final


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
            files, a ``.metadata`` from another run, a checksum mismatch.
        FileNotFoundError: On every rank, nothing changed: no checkpoint there.
        StateDictMismatchError: On every rank, nothing changed: a target key missing from the
            checkpoint or with another global shape or dtype, or (``strict=True``) checkpoint
            keys the targets lack.
        RankDisagreementError: On every rank, nothing changed: the ranks passed different
            ``directory`` paths or targets that do not fit together.
        UnsafeCheckpointError: On every rank: ``.metadata`` or a non-tensor item asks the
            unpickler for something outside the allow-list.
        RuntimeError: ``dcp.load`` failed on some rank (nothing was loaded, or with
            ``in_place=True`` the state is partly loaded), or a checkpoint collective failed or
            timed out.
    """
    rank, world, _ = dist_info(process_group)
    given = os.path.abspath(os.fspath(directory))
    path = resolve(given)
    err: Failure | None = None
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
            given,
            verify_checksums=verify_checksums,
            require_marker=require_marker,
            _part=(rank, world),
        )
        metadata = safe_read_metadata(path)  # once: the checks here and dcp.load's reader
        errors, ckpt_keys = check_targets(path, target_flat, metadata)
        if errors:
            err = Failure("StateDictMismatchError", ("\n  ".join(errors),))
    except Exception as exc:
        err = failure_of(exc)
    # the rank agreement: ONE all-reduce of the digests; every rank's findings, signatures and
    # directory only when some rank found something or the digests differ
    verdict = agreed(err, process_group, digest=digest or [-1, -1], detail=(sig, given))
    if not verdict.same:
        assert verdict.details is not None
        agree_on_directory([d[1] for d in verdict.details], "load from", "nothing was loaded")
    raise_agreed(verdict, f"refusing to load {path} (nothing was loaded)")
    ranks = group_ranks(process_group, world)
    if verdict.same:
        sigs = [sig]
        errors = check_uniform(sig, ranks)
    else:
        assert verdict.details is not None
        sigs = [d[0] for d in verdict.details]
        errors = check_agreement(sigs, ranks)
    if errors:
        raise_agreed(
            {0: Failure("RankDisagreementError", ("\n  ".join(errors[:30]),))},
            f"ranks disagree on the state dict to load from {path} (nothing loaded)",
        )
    if strict:  # the same file and the same targets on every rank: the same verdict
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

    import torch.distributed.checkpoint as dcp

    target = state_dict if in_place else clone(state_dict)
    outcome: Failure | None = None
    try:
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(path, metadata=metadata),
            planner=planner if planner is not None else SafeLoadPlanner(),
            process_group=process_group,
        )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        try:
            raise_unsafe(exc)
            outcome = Failure(
                "RuntimeError", (f"dcp.load failed: {type(exc).__name__}: {str(exc)[:2000]}",)
            )
        except UnsafeCheckpointError as unsafe:
            outcome = failure_of(unsafe)
    state = "partly loaded (in_place=True)" if in_place else "nothing was loaded"
    raise_agreed(agreed(outcome, process_group), f"loading {path} failed ({state})")
    if not in_place:
        swap_in(state_dict, target)
    return marker
