"""Publishing a checkpoint: staged, then renamed into place only once it is whole.

Map: ``check_name`` refuses the names reserved for staging and replaced directories;
``publish`` (rank 0, after every rank reported its writes) writes the checksums and the
completion marker durably (``write_json``: fsync, atomic rename) and renames the staging
directory to the final name, or swaps it with the old checkpoint in one atomic
``renameat2(RENAME_EXCHANGE)`` (``_exchange``; a two-rename fallback leaves ``.old-*``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any

from ._check_checkpoint import (
    CHECKSUMS_FILE,
    COMPLETE_MARKER,
    FORMAT,
    RESERVED,
    STAGING_SUFFIX,
    IncompleteCheckpointError,
    sha256,
)

__all__ = ["check_name", "publish", "write_json"]


def check_name(final: str) -> None:
    """Refuse names this module uses for its own directories (staging, replaced checkpoints)."""
    if RESERVED.search(final):
        raise ValueError(
            f"{final}: names ending in {STAGING_SUFFIX!r} or '.old-<8 hex digits>' are reserved "
            "for the staging and replaced directories of save_checkpoint (loading and inspect "
            "would read it as an unfinished or stale save). Choose another name."
        )


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


def write_json(path: str, obj: Any, *, compact: bool = False) -> None:
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


def publish(
    staging, final, reports, checksums, overwrite, world, metadata, timings, save_id=None
) -> None:
    """Rank 0, once every rank reported its writes: checksums, marker (carrying ``save_id``, the
    id every rank learned from the report gather), then the rename into place."""
    items = sorted((it for rep, _ in reports for it in rep), key=lambda i: (i["file"], i["start"]))
    if checksums:
        write_json(
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
        "save_id": save_id or uuid.uuid4().hex,
        "world_size": world,
        "time": time.time(),
        "files": files,
        "metadata_sha256": sha256(os.path.join(staging, ".metadata")),
        "checksums": CHECKSUMS_FILE if checksums else None,
        "items": len(items),
        "timings_s": timings,
        "user": dict(metadata) if metadata else {},
    }
    write_json(os.path.join(staging, COMPLETE_MARKER), marker)
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
        if RESERVED.search(name) and name.startswith(os.path.basename(final) + ".old-"):
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
