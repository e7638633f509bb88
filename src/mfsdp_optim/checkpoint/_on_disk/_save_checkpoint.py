"""``save_checkpoint``: publish a checkpoint only when every rank finished.

``_agree_on_content`` (ONE all-reduce of a digest; the detail only when it differs or a rank
failed) and ``_who_writes``, then ``write_files`` (``_write``) and ``_finish`` (the checksums,
one object gather of every rank's report, one all-reduce, rank 0's ``.metadata`` and publish,
one all-reduce of its verdict). The asynchronous save blocks for the copy and one all-reduce
(every rank staged) and runs the rest on its own gloo group, on the copy. The on-disk layout and
its guarantees: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from ..._infra.agreement import Failure, Verdict, failure_of
from ..._infra.host import paused_gc
from .._errors import RankDisagreementError
from . import _async
from ._check_checkpoint import (
    COMPLETE_MARKER,
    STAGING_SUFFIX,
    checkpoint_status,
    checksum_items,
    item_record,
)
from ._consensus import (
    agree_on_directory,
    agreed,
    check_agreement,
    check_uniform,
    collective_failed,
    dist_info,
    gather,
    group_ranks,
    raise_agreed,
    sig_digest,
    signatures,
    unwrap_stateful,
)
from ._publish import check_name, publish
from ._write import Written, plain_writers, write_files, write_metadata

__all__ = ["save_checkpoint"]


@paused_gc()
def save_checkpoint(
    state_dict: Mapping[str, Any],
    directory: str | os.PathLike,
    *,
    asynchronous: bool = False,
    checksums: bool = True,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    metadata: Mapping[str, Any] | None = None,
    writer_cls: type = FileSystemWriter,
    thread_count: int = 1,
) -> Any:
    """Save ``state_dict`` with ``torch.distributed.checkpoint`` and publish it atomically.

    Every rank of ``process_group`` calls it with its own state dict. First the ranks check,
    with one collective, that they agree on what they save: every DTensor key on exactly the
    ranks of its mesh with one global shape, dtype and layout, and plain tensors / objects equal
    wherever they appear (DCP keeps one copy of those); otherwise nothing is written. Each rank
    then writes its DCP files into ``<directory>.incomplete`` (DCP's planner and file writer;
    a chunk several ranks hold is written by one of them); once every rank reports its writes
    done, rank 0 writes DCP's ``.metadata``, the CRC32 of every item (``checksums=True``), the
    completion marker (file sizes, SHA-256 of ``.metadata``, ``metadata``) and renames the
    directory to ``directory``.

    With ``asynchronous=True`` it returns as soon as every rank copied its state off the live
    tensors (into host memory, pinned where CUDA is) and one all-reduce confirmed it, with a
    ``SaveHandle``; the ranks' agreement on what they save (on the copy), the write, the
    checksums and the publish run on a background thread, their collectives on a gloo group of
    their own, so a disagreement is raised by ``handle.wait()``. Training may step
    meanwhile: what is written is the copy. Every guarantee above holds (the Checkpoints page,
    "Asynchronous save"). One save is in flight per process: the next ``save_checkpoint`` or
    ``load_checkpoint`` first waits for it, and refuses, on every rank, when it failed and
    ``handle.wait()`` never raised its error.

    With ``overwrite=True`` the old directory is replaced after the new one is complete, in one
    atomic directory exchange where the OS offers it, so the name always holds a whole
    checkpoint, the old or the new one (the documentation's Reliability page describes the
    fallback). A stale ``<directory>.incomplete`` from a crashed save is deleted first.

    Args:
        state_dict: This rank's state dict, for example ``{"optimizer":
            opt.sharded_state_dict(), "grad_scaler": opt.grad_scaler_state_dict()}``.
        directory: Where the checkpoint is published; the same path on every rank. Names
            ending in ``.incomplete`` or ``.old-<8 hex digits>`` are reserved.
        asynchronous: Return once the state is staged, with a ``SaveHandle`` (``wait()``,
            ``done()``), instead of once it is published.
        checksums: Also write the CRC32 of every item DCP wrote (``mfsdp_checksums.json``),
            so a load catches bit flips.
        overwrite: Replace an existing ``directory`` (atomically, once the new one is complete).
        process_group: The ranks that save (default WORLD); every rank of it must call.
        metadata: Any JSON-able dict of yours, stored in the completion marker.
        writer_cls: The DCP storage writer class (a ``FileSystemWriter`` subclass) that writes
            each rank's files and rank 0's ``.metadata``.
        thread_count: The writer's thread count.

    Returns:
        The published checkpoint directory (as an absolute path), on every rank; with
        ``asynchronous=True`` a ``SaveHandle`` whose ``wait()`` returns it.

    Raises:
        RankDisagreementError: On every rank, nothing written, when the ranks disagree on what
            they save or pass different ``directory`` paths.
        ValueError: On every rank, for a reserved ``directory`` name.
        FileExistsError: On every rank, when ``directory`` exists and ``overwrite`` is False
            (or it exists and is not a directory).
        RuntimeError: Writing the files failed on some rank, or a rank died or was killed
            during the save (nothing was published, the previous checkpoint is untouched, the
            partial files are in ``<directory>.incomplete``), a checkpoint collective failed or
            timed out (the message says what is on disk: a rank that failed after the publish
            leaves the new checkpoint published and whole), the checkpoint could not be
            published, the state could not be staged, or the previous asynchronous save failed
            unreported. With ``asynchronous=True`` the errors after staging are raised by
            ``handle.wait()``.
    """
    t0 = time.perf_counter()
    rank, world, distributed = dist_info(process_group)
    final = os.path.abspath(os.fspath(directory))
    staging = final + STAGING_SUFFIX
    prep: Failure | None = _async.settle()  # a save in flight: wait; its unreported error
    created = False
    try:
        check_name(final)
        if rank == 0 and prep is None:
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
        prep = prep or failure_of(exc)
    try:
        state_dict = unwrap_stateful(state_dict)
    except Exception as exc:  # never leave the others waiting in the collective
        prep = prep or failure_of(exc)
    ranks = group_ranks(process_group, world)
    job = _Job(final, staging, rank, world, checksums, overwrite, metadata)
    writer = writer_cls(staging, thread_count=thread_count)
    me = dist.get_rank() if distributed else 0  # the global rank names this rank's files

    def write_and_finish(
        sd: Mapping[str, Any], on: dist.ProcessGroup | None, failed: Failure | None
    ) -> str:
        # what is saved, agreed (on the caller's group, or the background's) before any write
        try:
            verdict, sig = _agree_on_content(sd, final, failed, on, ranks)
            plain, err = _who_writes(verdict, sig, final, ranks)
        except BaseException:  # raised on every rank alike: the agreement's verdict
            if created:  # rank 0's empty staging directory: leave nothing behind
                shutil.rmtree(staging, ignore_errors=True)
            raise
        t_write = time.perf_counter()
        written: Written | None = None
        try:
            if err is None:
                written = write_files(
                    sd, writer, rank, me, frozenset(ranks), plain, not verdict.same
                )
        except Exception as exc:  # reported in the gather: nobody is left waiting
            err = exc
        return _finish(job, writer, written, err, on, time.perf_counter() - t_write)

    if not asynchronous:
        return write_and_finish(state_dict, process_group, prep)

    # asynchronous: the copy first, then ONE all-reduce (every rank staged, the directory is
    # ready, no unreported failure) before returning; what is saved is agreed in the
    # background, on the copy, so the caller waits for the copy and one collective only
    staged: dict[str, Any] = {}
    if prep is None:
        try:
            staged = _async.stage(state_dict)
        except Exception as exc:
            prep = failure_of(exc)
    try:
        raise_agreed(agreed(prep, process_group), f"cannot save the checkpoint {final}")
        # the background's collectives on a gloo group of their own (none in one process)
        try:  # a collective setup: a peer that died meanwhile fails it on this rank
            group = _async.background_group(process_group, ranks) if distributed else None
        except RuntimeError as exc:
            raise collective_failed(exc) from exc
    except BaseException:
        if created:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return _async.start(final, lambda: write_and_finish(staged, group, None), t0)


def _agree_on_content(
    state_dict: Mapping[str, Any],
    final: str,
    failure: Failure | None,
    group: dist.ProcessGroup | None,
    ranks: list[int],
) -> tuple[Verdict, dict[str, tuple]]:
    """The ranks' verdict on what they save into ``final``, and this rank's signatures: ONE
    all-reduce of a digest of the signatures; every rank's signatures and directory only when
    the digests differ or some rank failed (``failure``, or here). Raises on every rank, nothing
    written, when some rank failed."""
    sig: dict[str, tuple] = {}
    digest: list[int] = []
    try:
        sig = signatures(state_dict, values=True)
        digest = sig_digest(sig, final)
    except Exception as exc:  # never leave the others waiting in the collective
        sig, digest, failure = {}, [], failure or failure_of(exc)
    verdict = agreed(failure, group, digest=digest or [-1, -1], detail=(sig, final))
    raise_agreed(verdict, f"cannot save the checkpoint {final}")
    return verdict, sig


def _who_writes(
    verdict: Verdict, sig: dict[str, tuple], final: str, ranks: list[int]
) -> tuple[dict, Exception | None]:
    """From the agreement (the same on every rank): which rank writes each plain item, or
    ``RankDisagreementError`` raised on every rank (every DTensor key on exactly the ranks of
    its mesh with one signature, plain values equal wherever they appear, one directory).
    An unexpected error of this rank's alone is returned, to ride in the report gather."""
    try:
        if verdict.same:
            errors = check_uniform(sig, ranks)
            everyone = list(range(len(ranks)))
            plain = plain_writers({k: (s, everyone) for k, s in sig.items()})
        else:
            assert verdict.details is not None
            agree_on_directory([d[1] for d in verdict.details], "save into", "nothing written")
            errors = check_agreement([d[0] for d in verdict.details], ranks)
            holders: dict[str, tuple[tuple, list[int]]] = {}
            for i, (s_i, _) in enumerate(verdict.details):
                for k, s in s_i.items():
                    holders.setdefault(k, (s, []))[1].append(i)
            plain = plain_writers(holders)
    except RankDisagreementError:
        raise
    except Exception as exc:
        return {}, exc
    if errors:
        raise_agreed(
            {0: Failure("RankDisagreementError", ("\n  ".join(errors[:30]),))},
            f"ranks disagree on the state dict to save into {final} (nothing written)",
        )
    return plain, None


class _Job(NamedTuple):
    """What the write and the publish of one save need, fixed before DCP runs."""

    final: str
    staging: str
    rank: int
    world: int
    checksums: bool
    overwrite: bool
    metadata: Mapping[str, Any] | None


def _finish(
    job: _Job,
    writer: Any,
    written: Written | None,
    err: BaseException | None,
    group: dist.ProcessGroup | None,
    t_save: float,
) -> str:
    """After this rank wrote its files (``written``; ``err``: why it could not): the checksums,
    one object gather of every rank's report (rank 0 adds the save's id), one all-reduce
    (every rank read the reports and every write succeeded), rank 0's ``.metadata`` and
    publish, one all-reduce of its verdict. Runs on the caller's thread (synchronous) or the
    background one (on its own group). Every rank issues every collective: an error of this
    rank's before, between or after them rides in the next one, so no rank is left waiting and
    nothing is published unless every rank got through the gather."""
    final, staging = job.final, job.staging
    t0 = time.perf_counter()
    save_id = uuid.uuid4().hex if job.rank == 0 else None
    stage = "write"
    try:
        if err is not None:
            raise err
        assert written is not None
        stage = "checksum"
        mine = [item_record(fqn, off, info) for fqn, off, _, info, _ in written.items]
        report = (checksum_items(staging, mine) if job.checksums else mine, None, save_id, written)
        stage = "report"
        payload = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # still reported: the gather is entered by every rank
        failed_report: tuple = ([], (stage, type(exc).__name__, str(exc)[:2000]), save_id, None)
        payload = pickle.dumps(failed_report, protocol=pickle.HIGHEST_PROTOCOL)
    t_crc = time.perf_counter() - t0
    raw: list[bytes] | None = None
    local: Failure | None = None
    try:
        raw = gather(payload, group)
    except RuntimeError as exc:  # a rank died, was killed or stopped before it reported
        cause = exc.__cause__ or exc
        raise RuntimeError(
            f"writing the checkpoint {final} failed: a rank died, was killed or stopped while "
            f"the ranks wrote their files (it did not reach the gather of their reports). "
            f"{_on_disk(final, None)} Cause: {type(cause).__name__}: {str(cause)[:1000]}"
        ) from exc
    except Exception as exc:  # not the collective's (gloo raises RuntimeError): this rank's
        local = failure_of(exc)  # reading of what it received; every rank got its bytes
    # every rank reads the reports; rank 0 refuses a failed write: ONE all-reduce says whether
    # the publish goes ahead (any rank's error here, or in a report, stops it everywhere)
    reports: list[tuple] = []
    try:
        if raw is not None:
            reports = _read_reports(raw, job.world)
        failed = [r for r, rep in enumerate(reports) if rep[1] is not None]
        if failed and job.rank == 0:
            raise RuntimeError(
                f"writing the checkpoint {final} failed on ranks {failed}: "
                + "; ".join(
                    f"rank {r} ({reports[r][1][0]}): {reports[r][1][1]}: {reports[r][1][2]}"
                    for r in failed
                )
            )
    except Exception as exc:
        local = failure_of(exc)
    raise_agreed(
        agreed(local, group),
        f"could not publish the checkpoint {final}. Nothing was published: the previous "
        f"checkpoint is untouched and this save's files are in {staging}",
    )
    save_id = reports[0][2]  # every rank now knows the id the marker will carry

    outcome: Failure | None = None
    if job.rank == 0:
        try:
            write_metadata(writer, [rep[3] for rep in reports])
            publish(
                staging,
                final,
                [(rep[0], None) for rep in reports],
                job.checksums,
                job.overwrite,
                job.world,
                job.metadata,
                {"dcp_save_s": t_save, "checksum_s": t_crc},
                save_id=save_id,
            )
        except Exception as exc:
            outcome = failure_of(exc)
    try:
        verdict = agreed(outcome, group)
    except RuntimeError as exc:  # a rank died after the gather: say what is on disk
        cause = exc.__cause__ or exc
        raise RuntimeError(
            f"the ranks' last agreement on the checkpoint {final} failed: a rank died, was "
            f"killed or stopped after every rank had written its files. "
            f"{_on_disk(final, save_id)} Cause: {type(cause).__name__}: {str(cause)[:1000]}"
        ) from exc
    raise_agreed(verdict, f"could not publish the checkpoint {final}")
    return final


def _read_reports(raw: list[bytes], world: int) -> list[tuple]:
    """Every rank's report from the gathered payloads: ``(checksum rows, error, save id,
    Written)``; one per rank."""
    reports = [pickle.loads(b) for b in raw]
    if len(reports) != world:
        raise RuntimeError(f"{len(reports)} reports gathered from a group of {world} ranks")
    return reports


def _on_disk(final: str, save_id: str | None) -> str:
    """What the disk holds for ``final`` after the publish verdict could not be agreed."""
    try:
        with open(os.path.join(final, COMPLETE_MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        marker = None
    if isinstance(marker, dict) and save_id is not None and marker.get("save_id") == save_id:
        return (
            f"On disk: this save WAS published: {final} is complete (its completion marker "
            f"carries this save's id {save_id}) and loads; only the ranks' final agreement on "
            "it failed."
        )
    if os.path.isdir(final + STAGING_SUFFIX):
        return (
            f"On disk: Nothing was published: {final} "
            + ("still holds the previous checkpoint" if os.path.isdir(final) else "does not exist")
            + f"; this save's files are in {final + STAGING_SUFFIX}."
        )
    return f"On disk: {checkpoint_status(final)[1]}"
