"""``save_checkpoint`` / ``load_checkpoint``: publish a checkpoint only when every rank finished,
and refuse incomplete, damaged or foreign ones before a single byte reaches the live state.

On disk (``directory`` = ``ckpt/step_000100``)::

    ckpt/step_000100.incomplete/      while saving: DCP's files land here (staging)
        __0_0.distcp  __1_0.distcp  .metadata   (written by torch.distributed.checkpoint)
        mfsdp_checksums.json          per-item CRC32 of every byte range DCP wrote (optional)
        mfsdp_complete.json           the completion marker, written LAST, by rank 0, only after
                                      every rank reported its writes done
    ckpt/step_000100/                 the same directory, renamed once the marker is on disk

A rank killed mid-save leaves ``step_000100.incomplete`` without a marker; ``step_000100`` never
appears, so the previous checkpoint stays the newest complete one. The marker records the size of
every file and the SHA-256 of ``.metadata``, so a truncated or missing shard and a ``.metadata``
from another run are caught from the marker alone, before anything is unpickled; the checksums
catch bit flips. ``load_checkpoint`` runs all of these checks (the checksum reads split over the
ranks) and agrees on the verdict with ONE collective before calling ``dcp.load``, which then
writes into staging copies that replace the live values only once every rank loaded: DCP copies
into the live optimizer state in place (``sharded_state_dict(is_loading=True)`` shares storage
with it), so a load that failed half-way would leave it half-overwritten.

Collectives of ``save_checkpoint``: one ``all_gather_object`` (keyspace and directory agreement
across ranks, staging prepared), ``dcp.save``'s own, one ``all_gather_object`` (every rank's
writes and checksums) and one ``broadcast_object_list`` (the publish verdict). Of
``load_checkpoint``: one ``all_gather_object`` (findings, keyspace, directory), ``dcp.load``'s
own, one ``all_gather_object`` (every rank loaded). ``overwrite=True`` swaps the old and the new
directory in one atomic ``renameat2(RENAME_EXCHANGE)`` where the OS offers it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from ._load import StateDictMismatchError
from ._safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    raise_unsafe,
    safe_read_metadata,
)

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

STAGING_SUFFIX = ".incomplete"
COMPLETE_MARKER = "mfsdp_complete.json"
CHECKSUMS_FILE = "mfsdp_checksums.json"
FORMAT = "mfsdp_optim.checkpoint/1"
_CHUNK = 1 << 22


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint's save never finished (a rank died, or it is still being written)."""


class CorruptCheckpointError(ValueError):
    """The checkpoint is complete but its files are damaged, missing or from another save."""


class RankDisagreementError(ValueError):
    """Ranks called a checkpoint collective with different state dicts; raised on every rank."""


# ---------------------------------------------------------------------------------------------
# process-group helpers (everything also works without a process group, in one process)


def _dist(group) -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def _gather(obj: Any, group) -> list[Any]:
    _, world, on = _dist(group)
    if not on:
        return [obj]
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as exc:
        raise _collective_failed(exc) from exc
    return out


def _collective_failed(exc: BaseException) -> RuntimeError:
    return RuntimeError(
        "a checkpoint collective failed or timed out: some rank of the process group did not "
        "reach save_checkpoint/load_checkpoint (it died, was killed, or is running other code); "
        f"nothing was published or loaded. Cause: {type(exc).__name__}: {exc}"
    )


def _broadcast(obj: Any, group) -> Any:
    _, _, on = _dist(group)
    if not on:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except RuntimeError as exc:
        raise _collective_failed(exc) from exc
    return box[0]


def _raise_agreed(errors: list[tuple[str, str] | None], what: str) -> None:
    """Raise on every rank the first error any rank reported (all ranks hold the same list)."""
    found = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not found:
        return
    kinds = {
        "IncompleteCheckpointError": IncompleteCheckpointError,
        "CorruptCheckpointError": CorruptCheckpointError,
        "RankDisagreementError": RankDisagreementError,
        "StateDictMismatchError": StateDictMismatchError,
        "UnsafeCheckpointError": UnsafeCheckpointError,
        "FileExistsError": FileExistsError,
        "FileNotFoundError": FileNotFoundError,
        "ValueError": ValueError,
        "TypeError": TypeError,
    }
    kind = kinds.get(found[0][1][0], RuntimeError)
    lines: dict[str, list[int]] = {}
    for r, (_, msg) in found:
        lines.setdefault(msg, []).append(r)
    body = "\n  ".join(
        f"{m} (rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))})"
        for m, rs in list(lines.items())[:20]
    )
    raise kind(f"{what}:\n  {body}")


def _as_error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


# ---------------------------------------------------------------------------------------------
# rank agreement: what each rank is about to save / load into


def _flat(state_dict: Mapping) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dict(state_dict))
    return flat


def _signature(value: Any, values: bool, meshes: dict[int, tuple]) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        m = value.device_mesh
        ranks = meshes.get(id(m))
        if ranks is None:
            ranks = meshes[id(m)] = tuple(torch.as_tensor(m.mesh).flatten().tolist())
        return (
            "dtensor",
            tuple(value.shape),
            str(value.dtype),
            ranks,
            tuple(str(p) for p in value.placements),
        )
    if isinstance(value, torch.Tensor):
        shown = value.detach().cpu().flatten().tolist() if values and value.numel() <= 16 else None
        return ("tensor", tuple(value.shape), str(value.dtype), shown)
    text = repr(value) if values else ""
    if len(text) > 200:  # shown cut short, compared whole
        text = text[:200] + "... (sha256 " + hashlib.sha256(text.encode()).hexdigest()[:16] + ")"
    return ("object", type(value).__name__, text)


def _signatures(state_dict: Mapping, values: bool) -> dict[str, tuple]:
    meshes: dict[int, tuple] = {}
    return {k: _signature(v, values, meshes) for k, v in _flat(state_dict).items()}


def _check_agreement(sigs: list[dict[str, tuple]], ranks: list[int]) -> list[str]:
    """Every DTensor key emitted by exactly the ranks of its mesh, with one signature; plain
    tensors and objects equal wherever they appear (DCP keeps only one copy of those)."""
    errors: list[str] = []
    seen: dict[str, tuple[int, tuple]] = {}
    emitters: dict[str, set[int]] = {}
    for rank, sig in zip(ranks, sigs, strict=True):
        for key, s in sig.items():
            emitters.setdefault(key, set()).add(rank)
            if key not in seen:
                seen[key] = (rank, s)
            elif seen[key][1] != s:
                r0, s0 = seen[key]
                errors.append(
                    f"{key!r}: rank {r0} has {_describe(s0)}, rank {rank} has {_describe(s)}"
                )
    members = set(ranks)
    for key, (_, s) in seen.items():
        if s[0] == "dtensor":
            want = set(s[3]) & members
            got = emitters[key]
            if got != want:
                missing, extra = sorted(want - got), sorted(got - want)
                errors.append(
                    f"{key!r}: a DTensor on mesh ranks {sorted(s[3])}, but "
                    + (f"ranks {missing} do not have it" if missing else "")
                    + (" and " if missing and extra else "")
                    + (f"ranks {extra} outside its mesh have it" if extra else "")
                    + " (a rank with a different model or optimizer state?)"
                )
    return errors


def _describe(sig: tuple) -> str:
    if sig[0] == "dtensor":
        return f"a DTensor {list(sig[1])} {sig[2]} on mesh ranks {list(sig[3])} {list(sig[4])}"
    if sig[0] == "tensor":
        return f"a tensor {list(sig[1])} {sig[2]}" + (f" = {sig[3]}" if sig[3] is not None else "")
    return f"a {sig[1]} {sig[2]}"


def _group_ranks(group, world: int) -> list[int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return list(range(world))
    return list(dist.get_process_group_ranks(group))


def _agree_on_directory(paths: list[str], verb: str, nothing: str) -> None:
    """Raise on every rank unless every rank passed the same (absolute) directory."""
    if len(set(paths)) <= 1:
        return
    by_path: dict[str, list[int]] = {}
    for r, p in enumerate(paths):
        by_path.setdefault(p, []).append(r)
    shown = "; ".join(f"{p!r} on ranks {rs}" for p, rs in list(by_path.items())[:8])
    raise RankDisagreementError(
        f"ranks disagree on the checkpoint directory to {verb} ({nothing}): {shown}. Every rank "
        "must pass the same path (one checkpoint holds every rank's shards); build it from "
        "values all ranks share (the step, not the rank or a per-rank timestamp)."
    )


_RESERVED = re.compile(re.escape(STAGING_SUFFIX) + r"$|\.old-[0-9a-f]{8}$")


def _check_name(final: str) -> None:
    """Refuse names this module uses for its own directories (staging, replaced checkpoints)."""
    if _RESERVED.search(final):
        raise ValueError(
            f"{final}: names ending in {STAGING_SUFFIX!r} or '.old-<8 hex digits>' are reserved "
            "for the staging and replaced directories of save_checkpoint (loading and inspect "
            "would read it as an unfinished or stale save). Choose another name."
        )


# ---------------------------------------------------------------------------------------------
# files


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any, *, compact: bool = False) -> None:
    """``obj`` as JSON at ``path``, durably (fsync, then an atomic rename). ``compact``: one
    line, no spaces, encoded in one go (the per-item checksums: ``json.dump`` with an indent is
    several times slower on thousands of items); otherwise indented for people."""
    text = (
        json.dumps(obj, sort_keys=True, separators=(",", ":"))
        if compact
        else json.dumps(obj, indent=1, sort_keys=True)
    )
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _crc_range(f, start: int, length: int) -> int:
    f.seek(start)
    crc, left = 0, length
    while left > 0:
        block = f.read(min(_CHUNK, left))
        if not block:
            return -1  # short file: cannot match any recorded CRC
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def _item_record(index, info) -> dict:
    return {
        "key": index.fqn,
        "chunk": None if index.offset is None else list(index.offset),
        "file": info.relative_path,
        "start": int(info.offset),
        "length": int(info.length),
    }


def _checksum_items(directory: str, items: list[dict]) -> list[dict]:
    by_file: dict[str, list[dict]] = {}
    for it in items:
        by_file.setdefault(it["file"], []).append(it)
    out = []
    for name, its in by_file.items():
        with open(os.path.join(directory, name), "rb") as f:
            for it in sorted(its, key=lambda i: i["start"]):
                out.append({**it, "crc32": _crc_range(f, it["start"], it["length"])})
    return out


def _capturing(writer_cls: type) -> type:
    """``writer_cls`` that remembers this rank's WriteResults (file, offset, length per item)."""

    class _Capturing(writer_cls):  # type: ignore[misc, valid-type]
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            self.mfsdp_results = list(fut.wait())
            return fut

    _Capturing.__name__ = f"Capturing{writer_cls.__name__}"
    return _Capturing


# ---------------------------------------------------------------------------------------------
# save


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
    checkpoint, the old or the new one (see docs/reliability.md for the fallback). A stale
    ``<directory>.incomplete`` from a crashed save is deleted first.

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
    rank, world, _ = _dist(process_group)
    final = os.path.abspath(os.fspath(directory))
    staging = final + STAGING_SUFFIX
    prep: tuple[str, str] | None = None
    created = False
    try:
        _check_name(final)
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
        prep = _as_error(exc)
    try:
        sig = _signatures(state_dict, values=True)
    except Exception as exc:  # never leave the others waiting in the collective
        sig, prep = {}, prep or _as_error(exc)
    gathered = _gather((sig, prep, final), process_group)
    try:
        _raise_agreed([g[1] for g in gathered], f"cannot save the checkpoint {final}")
        _agree_on_directory([g[2] for g in gathered], "save into", "nothing written")
        errors = _check_agreement([g[0] for g in gathered], _group_ranks(process_group, world))
        if errors:
            _raise_agreed(
                [("RankDisagreementError", "\n  ".join(errors[:30]))],
                f"ranks disagree on the state dict to save into {final} (nothing written)",
            )
    except BaseException:
        if created:  # rank 0's empty staging directory: leave nothing behind
            shutil.rmtree(staging, ignore_errors=True)
        raise

    import torch.distributed.checkpoint as dcp

    writer = _capturing(writer_cls)(staging, thread_count=thread_count)
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
        mine = [_item_record(r.index, r.storage_data) for r in getattr(writer, "mfsdp_results", [])]
        report = (_checksum_items(staging, mine) if checksums else mine, None)
    except Exception as exc:
        report = ([], _as_error(exc))
    t_crc = time.perf_counter() - t0 - t_save
    reports = _gather(report, process_group)

    verdict: tuple[str, str] | None = None
    if rank == 0:
        try:
            failed = [r for r, (_, e) in enumerate(reports) if e is not None]
            if failed:
                raise RuntimeError(
                    f"ranks {failed} could not checksum their files: "
                    f"{[reports[r][1] for r in failed]}"
                )
            _publish(
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
            verdict = _as_error(exc)
    verdict = _broadcast(verdict, process_group)
    _raise_agreed([verdict], f"could not publish the checkpoint {final}")
    return final


def _publish(staging, final, reports, checksums, overwrite, world, metadata, timings) -> None:
    items = sorted((it for rep, _ in reports for it in rep), key=lambda i: (i["file"], i["start"]))
    if checksums:
        _write_json(
            os.path.join(staging, CHECKSUMS_FILE), {"format": FORMAT, "items": items}, compact=True
        )
    files = {}
    for name in sorted(os.listdir(staging)):
        path = os.path.join(staging, name)
        if os.path.isfile(path) and name != COMPLETE_MARKER:
            files[name] = os.path.getsize(path)
    if ".metadata" not in files:
        raise IncompleteCheckpointError(f"{staging}: DCP wrote no .metadata")
    marker = {
        "format": FORMAT,
        "complete": True,
        "save_id": uuid.uuid4().hex,
        "world_size": world,
        "time": time.time(),
        "files": files,
        "metadata_sha256": _sha256(os.path.join(staging, ".metadata")),
        "checksums": CHECKSUMS_FILE if checksums else None,
        "items": len(items),
        "timings_s": timings,
        "user": dict(metadata) if metadata else {},
    }
    _write_json(os.path.join(staging, COMPLETE_MARKER), marker)
    _fsync_dir(staging)
    parent = os.path.dirname(final)
    if not os.path.exists(final):
        os.rename(staging, final)
        _fsync_dir(parent)
    elif not overwrite:
        raise FileExistsError(
            f"{final} appeared while saving; the new checkpoint stays in {staging}"
        )
    elif _exchange(staging, final):
        # one atomic step: before it the name holds the old checkpoint, after it the new one;
        # the old one now sits under the staging name, which every reader treats as stale
        _fsync_dir(parent)
        shutil.rmtree(staging, ignore_errors=True)
    else:  # no atomic exchange here: a crash between the renames leaves the old one as .old-*
        old = final + f".old-{marker['save_id'][:8]}"
        os.rename(final, old)
        os.rename(staging, final)
        _fsync_dir(parent)
    for name in os.listdir(parent):  # replaced checkpoints of this name (a crashed fallback)
        if _RESERVED.search(name) and name.startswith(os.path.basename(final) + ".old-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the directories ``a`` and ``b`` (Linux renameat2 RENAME_EXCHANGE);
    False where the OS or file system cannot."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def _resolve(path: str) -> str:
    """``path``, or the previous checkpoint a crashed fallback overwrite left for it."""
    if os.path.exists(path):
        return path
    return _replaced(path) or path


def _replaced(path: str) -> str | None:
    """The checkpoint a crashed fallback overwrite left as ``<path>.old-*`` while ``path`` is
    missing (the name still resolves to it), else None."""
    parent, base = os.path.split(path)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for name in names:
        if (
            name.startswith(base + ".old-")
            and _RESERVED.search(name)
            and os.path.isfile(os.path.join(parent, name, COMPLETE_MARKER))
        ):
            return os.path.join(parent, name)
    return None


# ---------------------------------------------------------------------------------------------
# completeness and integrity


def checkpoint_status(directory: str | os.PathLike) -> tuple[str, str]:
    """``(status, message)`` of ``directory`` without reading any tensor data or unpickling.

    Purely local (no collective); it only lists directories.

    Args:
        directory: The checkpoint directory (or a ``<directory>.incomplete`` staging one).

    Returns:
        status (str): ``"complete"`` (this package's marker; also when a crashed overwrite left
            the name resolving to the previous checkpoint), ``"dcp"`` (a finished DCP checkpoint
            without the marker: written by plain ``dcp.save``), ``"incomplete"`` or
            ``"missing"``.
        message (str): A sentence saying what was found and, for an incomplete checkpoint,
            what to do.
    """
    path = os.path.abspath(os.fspath(directory))
    if not os.path.exists(path) and _replaced(path) is not None:
        return "complete", (
            f"{path}: complete (mfsdp_optim save_checkpoint; an overwrite of "
            f"it crashed, so the name resolves to the previous one, "
            f"{_replaced(path)})"
        )
    if path.endswith(STAGING_SUFFIX):
        return "incomplete", (
            f"{path}: INCOMPLETE checkpoint: this is the staging directory of a save that never "
            "finished (a rank died or was killed during the save, or it is still running); it "
            "was never published. Load the previous checkpoint; delete this directory."
        )
    if not os.path.isdir(path):
        if os.path.isdir(path + STAGING_SUFFIX):
            return "incomplete", (
                f"{path}: INCOMPLETE checkpoint: the save never finished (a rank died or was "
                f"killed during it, or it is still running); what it wrote is in "
                f"{path + STAGING_SUFFIX}. Load the previous checkpoint."
            )
        return "missing", f"{path}: no such checkpoint directory"
    names = set(os.listdir(path))
    if COMPLETE_MARKER in names:
        return "complete", f"{path}: complete (mfsdp_optim save_checkpoint)"
    if ".metadata" in names:
        return "dcp", (
            f"{path}: a finished DCP checkpoint without this package's completion "
            "marker (written by plain dcp.save)"
        )
    if any(n.endswith(".distcp") for n in names):
        return "incomplete", (
            f"{path}: INCOMPLETE checkpoint: shard files but no .metadata, so the DCP save never "
            "finished (a rank died or was killed during it). Load the previous checkpoint."
        )
    return "missing", (
        f"{path}: no .metadata file, so this is not a finished DCP checkpoint (the "
        "save did not complete, or the path names another directory)"
    )


def _read_marker(path: str) -> dict:
    try:
        with open(os.path.join(path, COMPLETE_MARKER)) as f:
            marker = json.load(f)
        if (
            not isinstance(marker, dict)
            or marker.get("format") != FORMAT
            or not marker.get("complete")
        ):
            raise ValueError(f"format {marker.get('format') if isinstance(marker, dict) else '?'}")
        return marker
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{path}: unreadable completion marker {COMPLETE_MARKER} ({exc})"
        ) from None


def _check_files(path: str, marker: dict) -> list[str]:
    errors = []
    for name, size in sorted(marker["files"].items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            errors.append(f"{path}: missing file {name} (the save wrote {size} bytes)")
        elif os.path.getsize(file) != size:
            errors.append(
                f"{path}: {name} is {os.path.getsize(file)} bytes, the save wrote "
                f"{size} (truncated or replaced)"
            )
    meta = os.path.join(path, ".metadata")
    if os.path.isfile(meta) and _sha256(meta) != marker["metadata_sha256"]:
        errors.append(
            f"{path}: .metadata is not the file this save wrote (SHA-256 differs): "
            "copied from another run or modified; not unpickling it"
        )
    return errors


def _check_crcs(path: str, marker: dict, part: tuple[int, int]) -> list[str]:
    if not marker.get("checksums"):
        return []
    try:
        with open(os.path.join(path, marker["checksums"])) as f:
            items = json.load(f)["items"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{path}: unreadable {marker['checksums']} ({exc})"]
    me, parts = part
    files = sorted({it["file"] for it in items})
    mine = {f for i, f in enumerate(files) if i % parts == me}
    errors = []
    got = _checksum_items(
        path, [{k: v for k, v in it.items() if k != "crc32"} for it in items if it["file"] in mine]
    )
    want = {(it["file"], it["start"]): it["crc32"] for it in items}
    for it in got:
        if it["crc32"] != want[(it["file"], it["start"])]:
            chunk = f" chunk at {it['chunk']}" if it["chunk"] is not None else ""
            errors.append(
                f"{path}: checksum mismatch in {it['file']} bytes {it['start']}.."
                f"{it['start'] + it['length']}: {it['key']}{chunk} is damaged"
            )
    return errors


def check_checkpoint(
    directory: str | os.PathLike,
    *,
    verify_checksums: bool = True,
    require_marker: bool = True,
    _part: tuple[int, int] = (0, 1),
) -> dict:
    """Check ``directory`` without loading it.

    Reads only JSON and file bytes; it unpickles nothing. Purely local (no collective).

    Args:
        directory: The checkpoint directory (a name a crashed overwrite left resolving to the
            previous checkpoint is followed).
        verify_checksums: Also recompute the CRC32 of every item the save recorded
            (reads every byte of the shard files).
        require_marker: Refuse a plain DCP checkpoint (no completion marker, so nothing proves
            every rank finished writing it); with False it is accepted, its integrity then
            resting on DCP alone.
        _part: Private: ``(index, parts)``, the share of the checksum reads this call does
            (``load_checkpoint`` splits them over the ranks).

    Returns:
        Its completion marker (a dict), or ``{}`` for a plain DCP checkpoint accepted with
            ``require_marker=False``.

    Raises:
        IncompleteCheckpointError: The save never finished (or, with ``require_marker=True``,
            a plain DCP checkpoint without the marker).
        FileNotFoundError: No checkpoint there.
        CorruptCheckpointError: Missing, truncated or replaced files, a ``.metadata`` from
            another run, an unreadable marker, a checksum mismatch.
    """
    path = _resolve(os.path.abspath(os.fspath(directory)))
    status, msg = checkpoint_status(path)
    if status == "incomplete":
        raise IncompleteCheckpointError(msg)
    if status == "missing":
        raise FileNotFoundError(msg)
    if status == "dcp":
        if require_marker:
            raise IncompleteCheckpointError(
                f"{msg}: nothing proves every rank finished writing it. Pass "
                "require_marker=False to load it anyway (integrity then rests on DCP alone)."
            )
        return {}
    marker = _read_marker(path)
    errors = _check_files(path, marker)
    if not errors and verify_checksums:
        errors = _check_crcs(path, marker, _part)
    if errors:
        raise CorruptCheckpointError("\n  ".join(errors))
    return marker


# ---------------------------------------------------------------------------------------------
# load


def _check_targets(path: str, flat: dict[str, Any], metadata: Any) -> tuple[list[str], list[str]]:
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


def _unexpected(ckpt_keys: list[str], target_keys: set[str]) -> list[str]:
    """Checkpoint keys the target (the union over ranks) lacks, under a section it loads: a
    key ``a.b.rest`` counts when the target holds any key under ``a.b`` (``optimizer.state``),
    so loading one section of a bigger checkpoint (the optimizer without the model) stays
    possible, but not half of one (``max_exp_avg_sq`` dropped, or an FQN)."""
    sections = {".".join(k.split(".")[:2]) for k in target_keys}
    return [k for k in ckpt_keys if k not in target_keys and ".".join(k.split(".")[:2]) in sections]


def _clone(value: Any) -> Any:
    """A staging copy of a load target: containers copied, tensors cloned, the rest shared."""
    from torch.distributed.tensor import DTensor

    from .._infra.placement import copy_in_layout

    if isinstance(value, DTensor):
        return copy_in_layout(value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


@torch.no_grad()
def _swap_in(live: Any, staged: Any) -> None:
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
            _swap_in(old, new)
        elif new is not old:
            live[key] = new


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
    rank, world, _ = _dist(process_group)
    given = os.path.abspath(os.fspath(directory))
    path = _resolve(given)
    err: tuple[str, str] | None = None
    marker: dict = {}
    metadata: Any = None
    sig: dict = {}
    ckpt_keys: list[str] = []
    try:
        flat = _flat(state_dict)
        sig = _signatures(state_dict, values=False)
        marker = check_checkpoint(
            given,
            verify_checksums=verify_checksums,
            require_marker=require_marker,
            _part=(rank, world),
        )
        metadata = safe_read_metadata(path)  # once: the checks here and dcp.load's reader
        errors, ckpt_keys = _check_targets(path, flat, metadata)
        if errors:
            err = ("StateDictMismatchError", "\n  ".join(errors))
    except Exception as exc:
        err = _as_error(exc)
    gathered = _gather((sig, err, given), process_group)
    _agree_on_directory([g[2] for g in gathered], "load from", "nothing was loaded")
    _raise_agreed([g[1] for g in gathered], f"refusing to load {path} (nothing was loaded)")
    errors = _check_agreement([g[0] for g in gathered], _group_ranks(process_group, world))
    if errors:
        _raise_agreed(
            [("RankDisagreementError", "\n  ".join(errors[:30]))],
            f"ranks disagree on the state dict to load from {path} (nothing loaded)",
        )
    if strict:  # the same file and the same gathered targets on every rank: the same verdict
        extra = _unexpected(ckpt_keys, {k for g in gathered for k in g[0]})
        if extra:
            _raise_agreed(
                [
                    (
                        "StateDictMismatchError",
                        (
                            f"the checkpoint holds {len(extra)} key(s) the target lacks, "
                            f"e.g. {extra[:5]}: it was saved by an optimizer with other options "
                            "(for example amsgrad=True, loaded into amsgrad=False, which would "
                            "step without max_exp_avg_sq) or by another model. Build the "
                            "optimizer and model with the options of the save, or pass "
                            "strict=False to leave those entries out"
                        ),
                    )
                ],
                f"refusing to load {path} (nothing was loaded)",
            )

    import torch.distributed.checkpoint as dcp

    target = state_dict if in_place else _clone(state_dict)
    outcome: tuple[str, str] | None = None
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
            outcome = ("RuntimeError", f"dcp.load failed: {type(exc).__name__}: {str(exc)[:2000]}")
        except UnsafeCheckpointError as unsafe:
            outcome = _as_error(unsafe)
    outcomes = _gather(outcome, process_group)
    state = "partly loaded (in_place=True)" if in_place else "nothing was loaded"
    _raise_agreed(outcomes, f"loading {path} failed ({state})")
    if not in_place:
        _swap_in(state_dict, target)
    return marker
