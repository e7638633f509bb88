"""Completeness and integrity of a checkpoint on disk, read side: nothing here unpickles.

Map: the names on disk (``STAGING_SUFFIX``, ``COMPLETE_MARKER``, ``CHECKSUMS_FILE``, reserved
``.old-*``); ``IncompleteCheckpointError`` / ``CorruptCheckpointError``; the hashes (SHA-256 of
``.metadata``, CRC32 per item DCP wrote: ``item_record``, ``checksum_items``);
``checkpoint_status`` (listing only) and ``check_checkpoint`` (marker, file sizes, hashes, the
checksum reads split by ``_part``); ``resolve`` follows a name a crashed overwrite left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib

from .._errors import CorruptCheckpointError, IncompleteCheckpointError

__all__ = [
    "CHECKSUMS_FILE",
    "COMPLETE_MARKER",
    "FORMAT",
    "RESERVED",
    "STAGING_SUFFIX",
    "check_checkpoint",
    "checkpoint_status",
    "checksum_items",
    "item_record",
    "resolve",
    "sha256",
]

STAGING_SUFFIX = ".incomplete"
COMPLETE_MARKER = "mfsdp_complete.json"
CHECKSUMS_FILE = "mfsdp_checksums.json"
FORMAT = "mfsdp_optim.checkpoint/1"
_CHUNK = 1 << 22


RESERVED = re.compile(re.escape(STAGING_SUFFIX) + r"$|\.old-[0-9a-f]{8}$")


def sha256(path: str) -> str:
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


def item_record(fqn: str, offset, info) -> dict:
    """One row of the checksums file: the item's key, chunk offset, file and byte range."""
    return {
        "key": fqn,
        "chunk": None if offset is None else list(offset),
        "file": info.relative_path,
        "start": int(info.offset),
        "length": int(info.length),
    }


def checksum_items(directory: str, items: list[dict]) -> list[dict]:
    by_file: dict[str, list[dict]] = {}
    for it in items:
        by_file.setdefault(it["file"], []).append(it)
    out = []
    for name, its in by_file.items():
        with open(os.path.join(directory, name), "rb") as f:
            for it in sorted(its, key=lambda i: i["start"]):
                out.append({**it, "crc32": _crc_range(f, it["start"], it["length"])})
    return out


def resolve(path: str) -> str:
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
            and RESERVED.search(name)
            and os.path.isfile(os.path.join(parent, name, COMPLETE_MARKER))
        ):
            return os.path.join(parent, name)
    return None


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
    if os.path.isfile(meta) and sha256(meta) != marker["metadata_sha256"]:
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
    got = checksum_items(
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
    path = resolve(os.path.abspath(os.fspath(directory)))
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
