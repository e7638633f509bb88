"""``save_checkpoint``: publish a checkpoint only when every rank finished.

Map: ``save_checkpoint`` runs its phases in order: ``_make_staging`` (the name checked, rank 0's
staging directory), then ``_write_and_finish`` on the caller's thread or, ``asynchronous=True``,
``_save_async`` (the copy, ONE all-reduce that every rank staged) and ``_write_and_finish`` on
the background thread, on the copy, on a gloo group of its own. ``_write_and_finish``:
``_agree_on_content`` (ONE all-reduce of a digest of what each rank saves; the detail only when
it differs or a rank failed) and ``_who_writes``, ``write_files`` (``_write``), then ``_finish``:
``_report`` (this rank's checksums), ``_gather_reports`` (one object gather), ``_check_reports``
and one all-reduce (every write succeeded), ``_publish_and_agree`` (rank 0's ``_publish``, one
all-reduce of its verdict). Each phase keeps this rank's failure in an ``Attempt`` instead of
raising, so every rank enters every collective. The on-disk layout and its guarantees:
docs/reliability.md.
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

from ..._infra.agreement import Failure, Verdict
from ..._infra.attempt import Attempt
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
    attempt = Attempt(_async.settle())  # a save in flight: wait; its unreported error
    created = _make_staging(final, rank, overwrite, attempt)
    try:  # on every rank, whatever failed: a Stateful's state_dict() may run collectives
        state_dict = unwrap_stateful(state_dict)
    except Exception as exc:  # never leave the others waiting in the collective
        attempt.fail(exc)
    ranks = group_ranks(process_group, world)
    me = dist.get_rank() if distributed else 0  # the global rank names this rank's files
    job = _Job(
        final,
        final + STAGING_SUFFIX,
        rank,
        world,
        ranks,
        me,
        created,
        checksums,
        overwrite,
        metadata,
    )
    writer = writer_cls(job.staging, thread_count=thread_count)
    if not asynchronous:
        return _write_and_finish(job, writer, state_dict, process_group, attempt.failure)
    return _save_async(job, writer, state_dict, process_group, attempt, distributed, t0)


class _Job(NamedTuple):
    """What the write and the publish of one save need, fixed before DCP runs."""

    final: str
    staging: str
    rank: int
    world: int
    ranks: list[int]  # the saving group's global ranks
    me: int  # this rank's global rank (it names this rank's files)
    created: bool  # rank 0 made the staging directory (removed when the agreement fails)
    checksums: bool
    overwrite: bool
    metadata: Mapping[str, Any] | None


def _make_staging(final: str, rank: int, overwrite: bool, attempt: Attempt) -> bool:
    """Phase 1: the name checked on every rank; on rank 0 (unless ``attempt`` failed already)
    ``final`` refused where it exists and ``overwrite`` is False, a stale staging directory
    deleted and a fresh one made. Returns whether it was made; an error goes to ``attempt``."""
    staging = final + STAGING_SUFFIX
    try:
        check_name(final)
        if rank == 0 and attempt.ok:
            if os.path.exists(final) and not overwrite:
                raise FileExistsError(f"{final} already exists; pass overwrite=True to replace it")
            if os.path.exists(final) and not os.path.isdir(final):
                raise FileExistsError(
                    f"{final} exists and is not a directory; remove it or choose another name"
                )
            if os.path.exists(staging):
                shutil.rmtree(staging)  # what a crashed earlier save left behind
            os.makedirs(staging)
            return True
    except (OSError, ValueError) as exc:
        attempt.fail(exc)
    return False


def _write_and_finish(
    job: _Job,
    writer: Any,
    state_dict: Mapping[str, Any],
    group: dist.ProcessGroup | None,
    failed: Failure | None,
) -> str:
    """Phase 2, on the caller's thread (``group`` the caller's) or the background one (its own
    group, ``state_dict`` the copy): what is saved agreed before any write, this rank's files
    written, then ``_finish``."""
    try:
        verdict, sig = _agree_on_content(state_dict, job.final, failed, group, job.ranks)
        plain, err = _who_writes(verdict, sig, job.final, job.ranks)
    except BaseException:  # raised on every rank alike: the agreement's verdict
        if job.created:  # rank 0's empty staging directory: leave nothing behind
            shutil.rmtree(job.staging, ignore_errors=True)
        raise
    t_write = time.perf_counter()
    written: Written | None = None
    try:
        if err is None:
            members = frozenset(job.ranks)
            written = write_files(
                state_dict, writer, job.rank, job.me, members, plain, not verdict.same
            )
    except Exception as exc:  # reported in the gather: nobody is left waiting
        err = exc
    return _finish(job, writer, written, err, group, time.perf_counter() - t_write)


def _save_async(
    job: _Job,
    writer: Any,
    state_dict: Mapping[str, Any],
    process_group: dist.ProcessGroup | None,
    attempt: Attempt,
    distributed: bool,
    t0: float,
) -> _async.SaveHandle:
    """Phase 2 of ``asynchronous=True``: the copy first, then ONE all-reduce (every rank staged,
    the directory is ready, no unreported failure) before returning; what is saved is agreed in
    the background, on the copy, so the caller waits for the copy and one collective only."""
    staged: dict[str, Any] = attempt.run(_async.stage, state_dict, default={})
    try:
        raise_agreed(agreed(attempt, process_group), f"cannot save the checkpoint {job.final}")
        # the background's collectives on a gloo group of their own (none in one process)
        try:  # a collective setup: a peer that died meanwhile fails it on this rank
            group = _async.background_group(process_group, job.ranks) if distributed else None
        except RuntimeError as exc:
            raise collective_failed(exc) from exc
    except BaseException:
        if job.created:
            shutil.rmtree(job.staging, ignore_errors=True)
        raise
    return _async.start(job.final, lambda: _write_and_finish(job, writer, staged, group, None), t0)


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
    attempt = Attempt(failure)
    sig: dict[str, tuple] = {}
    digest: list[int] = []
    try:  # whatever failed before: the digest is what every rank compares
        sig = signatures(state_dict, values=True)
        digest = sig_digest(sig, final)
    except Exception as exc:  # never leave the others waiting in the collective
        sig, digest = {}, []
        attempt.fail(exc)
    verdict = agreed(attempt, group, digest=digest or [-1, -1], detail=(sig, final))
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


def _finish(
    job: _Job,
    writer: Any,
    written: Written | None,
    err: BaseException | None,
    group: dist.ProcessGroup | None,
    t_save: float,
) -> str:
    """After this rank wrote its files (``written``; ``err``: why it could not): ``_report``
    (the checksums), ``_gather_reports`` (one object gather of every rank's report, rank 0's
    with the save's id), one all-reduce (every rank read the reports and every write
    succeeded), ``_publish_and_agree`` (rank 0's ``.metadata`` and publish, one all-reduce of
    its verdict). Runs on the caller's thread (synchronous) or the background one (on its own
    group). Every rank issues every collective: an error of this rank's before, between or
    after them rides in the next one, so no rank is left waiting and nothing is published
    unless every rank got through the gather."""
    t0 = time.perf_counter()
    save_id = uuid.uuid4().hex if job.rank == 0 else None
    payload = _report(job, written, err, save_id)
    t_crc = time.perf_counter() - t0
    attempt = Attempt()
    raw = _gather_reports(job.final, payload, group, attempt)
    # every rank reads the reports; rank 0 refuses a failed write: ONE all-reduce says whether
    # the publish goes ahead (any rank's error here, or in a report, stops it everywhere)
    reports: list[tuple] = attempt.run(_check_reports, job, raw, default=[])
    raise_agreed(
        agreed(attempt, group),
        f"could not publish the checkpoint {job.final}. Nothing was published: the previous "
        f"checkpoint is untouched and this save's files are in {job.staging}",
    )
    save_id = reports[0][2]  # every rank now knows the id the marker will carry
    timings = {"dcp_save_s": t_save, "checksum_s": t_crc}
    _publish_and_agree(job, writer, reports, group, save_id, timings)
    return job.final


def _report(
    job: _Job, written: Written | None, err: BaseException | None, save_id: str | None
) -> bytes:
    """This rank's report, pickled: ``(checksum rows, error, save id, Written)``; a failure
    (``err``, or one here) rides in it as ``(stage, type, message)``, so the gather is entered
    by every rank."""
    stage = "write"
    try:
        if err is not None:
            raise err
        assert written is not None
        stage = "checksum"
        mine = [item_record(fqn, off, info) for fqn, off, _, info, _ in written.items]
        report = (
            checksum_items(job.staging, mine) if job.checksums else mine,
            None,
            save_id,
            written,
        )
        stage = "report"
        return pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # still reported: the gather is entered by every rank
        failed_report: tuple = ([], (stage, type(exc).__name__, str(exc)[:2000]), save_id, None)
        return pickle.dumps(failed_report, protocol=pickle.HIGHEST_PROTOCOL)


def _gather_reports(
    final: str, payload: bytes, group: dist.ProcessGroup | None, attempt: Attempt
) -> list[bytes] | None:
    """Every rank's report (one object gather). A failed collective raises, saying what is on
    disk; an error reading what this rank received goes to ``attempt`` (None returned)."""
    try:
        return gather(payload, group)
    except RuntimeError as exc:  # a rank died, was killed or stopped before it reported
        cause = exc.__cause__ or exc
        raise RuntimeError(
            f"writing the checkpoint {final} failed: a rank died, was killed or stopped while "
            f"the ranks wrote their files (it did not reach the gather of their reports). "
            f"{_on_disk(final, None)} Cause: {type(cause).__name__}: {str(cause)[:1000]}"
        ) from exc
    except Exception as exc:  # not the collective's (gloo raises RuntimeError): this rank's
        attempt.fail(exc)  # reading of what it received; every rank got its bytes
        return None


def _check_reports(job: _Job, raw: list[bytes] | None) -> list[tuple]:
    """Every rank's report read from the gathered ``raw``; rank 0 raises when a rank's write
    failed (the others learn it from the all-reduce that follows)."""
    if raw is None:
        return []
    reports = _read_reports(raw, job.world)
    failed = [r for r, rep in enumerate(reports) if rep[1] is not None]
    if failed and job.rank == 0:
        raise RuntimeError(
            f"writing the checkpoint {job.final} failed on ranks {failed}: "
            + "; ".join(
                f"rank {r} ({reports[r][1][0]}): {reports[r][1][1]}: {reports[r][1][2]}"
                for r in failed
            )
        )
    return reports


def _publish_and_agree(
    job: _Job,
    writer: Any,
    reports: list[tuple],
    group: dist.ProcessGroup | None,
    save_id: str,
    timings: dict[str, float],
) -> None:
    """Rank 0 writes DCP's ``.metadata`` from every rank's ``Written`` and publishes; ONE
    all-reduce of its verdict, raised on every rank alike (a failed collective says what is on
    disk)."""
    attempt = Attempt()
    if job.rank == 0:
        attempt.run(_publish, job, writer, reports, timings, save_id)
    try:
        verdict = agreed(attempt, group)
    except RuntimeError as exc:  # a rank died after the gather: say what is on disk
        cause = exc.__cause__ or exc
        raise RuntimeError(
            f"the ranks' last agreement on the checkpoint {job.final} failed: a rank died, was "
            f"killed or stopped after every rank had written its files. "
            f"{_on_disk(job.final, save_id)} Cause: {type(cause).__name__}: {str(cause)[:1000]}"
        ) from exc
    raise_agreed(verdict, f"could not publish the checkpoint {job.final}")


def _publish(
    job: _Job, writer: Any, reports: list[tuple], timings: dict[str, float], save_id: str
) -> None:
    """Rank 0: DCP's ``.metadata``, then the checksums, the marker and the atomic publish."""
    write_metadata(writer, [rep[3] for rep in reports])
    publish(
        job.staging,
        job.final,
        [(rep[0], None) for rep in reports],
        job.checksums,
        job.overwrite,
        job.world,
        job.metadata,
        timings,
        save_id=save_id,
    )


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
