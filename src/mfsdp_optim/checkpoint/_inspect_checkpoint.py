"""What a DCP checkpoint holds, and whether it is whole (``inspect_checkpoint``).

Map: ``_integrity`` checks the files first (marker sizes and SHA-256, or byte ranges of a plain
``dcp.save``); ``_collect`` sorts ``.metadata`` into optimizer params and other entries (a
model's); ``_read_items`` reads the small non-tensor items through the safe unpickler; ``_fill`` /
``_groups`` form param groups. No tensor data is read. Formats understood: 3, 2, 0.1.0's 1, and
torch's ``get_optimizer_state_dict`` layout. The command line over it: ``_cli``.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any

from ._errors import CorruptCheckpointError, IncompleteCheckpointError
from ._on_disk._check_checkpoint import check_checkpoint, checkpoint_status
from ._on_disk._safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    raise_unsafe,
    safe_read_metadata,
)

__all__ = ["inspect_checkpoint"]

_KINDS = ("state", "param_to_group_meta", "param_groups")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _path_of(key: str, planner_data: Any) -> tuple:
    if isinstance(planner_data, dict) and key in planner_data:
        return tuple(planner_data[key])
    return tuple(key.split("."))


def _split(path: tuple) -> tuple[str, str, tuple] | None:
    """(prefix, kind, rest) of a flattened optimizer key, or None for other keys; a format-3
    table is ``param_to_group_meta`` with an empty rest."""
    for i, part in enumerate(path):
        if part in _KINDS and (i + 1 < len(path) or part == "param_to_group_meta"):
            return ".".join(map(str, path[:i])), str(part), tuple(path[i + 1 :])
    return None


def _read_items(directory: str, keys: list[str]) -> dict[str, Any]:
    """The non-tensor items ``keys`` of the checkpoint, unpickled with ``weights_only=True``."""
    if not keys:
        return {}
    import torch.distributed.checkpoint as dcp

    # top-level keys that already are DCP's flat keys: the default planner maps each to itself
    # and writes the unpickled value back into this dict
    target: dict[str, Any] = dict.fromkeys(keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        try:
            dcp.load(
                target,
                storage_reader=SafeFileSystemReader(directory),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise_unsafe(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise CorruptCheckpointError(
                f"{directory}: cannot read its small items ({type(exc).__name__}: {str(exc)[:500]})"
            ) from None
    return target


def _shard_errors(directory: str, md) -> list[str]:
    """Byte ranges of ``.metadata`` that no file holds (a plain DCP checkpoint has no marker)."""
    sizes: dict[str, int] = {}
    errors: list[str] = []
    for index, info in (md.storage_data or {}).items():
        name = str(info.relative_path)
        if name not in sizes:
            file = os.path.join(directory, name)
            sizes[name] = os.path.getsize(file) if os.path.isfile(file) else -1
            if sizes[name] < 0:
                errors.append(f"{directory}: missing shard file {name}")
        end = int(info.offset) + int(info.length)
        if 0 <= sizes[name] < end:
            errors.append(
                f"{directory}: {name} is {sizes[name]} bytes but holds {index.fqn!r} "
                f"up to byte {end} (truncated)"
            )
            sizes[name] = -2  # one message per file
    return errors


def _integrity(directory: str, verify: bool) -> tuple[dict, str, str, bool]:
    """The marker (``{}`` without one), the status value, a line saying what was checked, and
    whether every item's CRC32 was verified; raises FileNotFoundError,
    IncompleteCheckpointError or CorruptCheckpointError."""
    status, message = checkpoint_status(directory)
    if status == "missing":
        raise FileNotFoundError(message)
    if status == "incomplete":
        raise IncompleteCheckpointError(message)
    if status == "complete":
        marker = check_checkpoint(directory, verify_checksums=verify)
        verified = bool(verify and marker.get("checksums"))
        checked = "file sizes and .metadata SHA-256" + (" and every item's CRC32" * verified)
        return marker, status, f"{message}; checked {checked} against the marker", verified
    detail = f"{message}; checked that every item lies inside an existing file"
    return {}, status, detail, False


def _tensor_entry(item) -> dict:
    size = list(item.size)
    dtype = str(item.properties.dtype).removeprefix("torch.")
    itemsize = getattr(item.properties.dtype, "itemsize", 0)
    return {"dtype": dtype, "shape": size, "bytes": math.prod(size) * itemsize}


def _collect(md) -> tuple[dict[str, dict], dict[str, tuple], dict[str, dict]]:
    """Per prefix the params' tensor entries, the non-tensor keys to read with their role, and
    per top-level key the other entries (a model's, the extra state), in ``.metadata`` order."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    found: dict[str, dict] = {}
    wanted: dict[str, tuple] = {}
    others: dict[str, dict] = {}
    for key, item in md.state_dict_metadata.items():
        path = _path_of(key, md.planner_data)
        parts = _split(path)
        if parts is None:
            top = str(path[0]) if len(path) > 1 else ""
            name = ".".join(map(str, path[1:] if top else path))
            group = others.setdefault(top, {"tensors": 0, "bytes": 0, "entries": {}})
            if isinstance(item, BytesStorageMetadata):
                group["entries"][name] = {"dtype": None, "shape": None, "bytes": None}
            else:
                group["entries"][name] = _tensor_entry(item)
                group["tensors"] += 1
                group["bytes"] += group["entries"][name]["bytes"]
            continue
        prefix, kind, rest = parts
        entry = found.setdefault(prefix, {"format": 2, "params": {}, "torch_groups": {}})

        def param(fqn: str, entry: dict = entry) -> dict:
            return entry["params"].setdefault(
                fqn, {"state": {}, "scalars": {}, "leaf": None, "hyper": {}}
            )

        if kind == "param_groups" and len(rest) == 2:
            entry["format"] = "torch"
            entry["torch_groups"].setdefault(int(rest[0]), {})[str(rest[1])] = None
            wanted[key] = (prefix, "group", int(rest[0]), str(rest[1]))
        elif kind == "param_to_group_meta" and not rest:
            entry["format"] = 3
            wanted[key] = (prefix, "table", None, None)
        elif kind == "param_to_group_meta" and len(rest) == 1:
            param(str(rest[0]))
            wanted[key] = (prefix, "leaf", str(rest[0]), None)
        elif kind == "param_to_group_meta" and len(rest) == 2:
            entry["format"] = 1 if entry["format"] != "torch" else "torch"
            param(str(rest[0]))["hyper"][str(rest[1])] = None
            wanted[key] = (prefix, "hyper", str(rest[0]), str(rest[1]))
        elif kind == "state" and len(rest) == 2:
            fqn, name = str(rest[0]), str(rest[1])
            if isinstance(item, BytesStorageMetadata):
                param(fqn)["scalars"][name] = None
                wanted[key] = (prefix, "scalar", fqn, name)
            else:
                param(fqn)["state"][name] = _tensor_entry(item)
    return found, wanted, others


def _fill(found: dict, wanted: dict[str, tuple], values: dict[str, Any] | None) -> None:
    """Put the read values (or nothing, without ``values``) into ``found`` and form groups."""
    for key, (prefix, role, a, b) in wanted.items():
        if values is None:
            continue
        v = values.get(key)
        entry = found[prefix]
        if role == "table":
            _fill_table(entry, v, key)
        elif role == "group":
            entry["torch_groups"][a][b] = v
        elif role == "leaf":
            entry["params"][a]["leaf"] = v
        elif role == "hyper":
            entry["params"][a]["hyper"][b] = v
        else:
            entry["params"][a]["scalars"][b] = v
    for entry in found.values():
        for p in entry["params"].values():
            leaf = p.pop("leaf")
            if isinstance(leaf, tuple) and len(leaf) == 2:
                p["hyper"] = dict(leaf[0])
                p["scalars"].update({k: v for k, v, _ in leaf[1]})
        if entry["format"] == "torch":
            for group in entry["torch_groups"].values():
                hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                for fqn in group.get("params") or []:
                    entry["params"].setdefault(str(fqn), {"state": {}, "scalars": {}, "hyper": {}})[
                        "hyper"
                    ] = hyper
        entry.pop("torch_groups")
        entry["groups"] = _groups(entry.pop("params"), values is not None)


def _fill_table(entry: dict, value: Any, key: str) -> None:
    """The params of a format-3 table (its tagged tuple, as read) into ``entry``; raises
    CorruptCheckpointError when the item is not a table this package can read."""
    from ._state_dict._table import as_table

    try:
        table = as_table(value, key)
    except ValueError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    for fqn, (hyper, scalars) in table.leaves():
        p = entry["params"].setdefault(fqn, {"state": {}, "scalars": {}, "leaf": None, "hyper": {}})
        p["hyper"] = dict(hyper)
        p["scalars"].update({k: v for k, v, _ in scalars})


def _groups(params: dict[str, dict], have_values: bool) -> list[dict]:
    """Params grouped by equal hyperparameters; groups and params in the order ``.metadata``
    lists them (the state dict's, i.e. the model's order)."""
    groups: dict[str, dict] = {}
    for fqn in params:
        p = params[fqn]
        hyper = p.pop("hyper") if have_values else {}
        key = repr(sorted(hyper.items()))
        g = groups.setdefault(
            key, {"hyperparameters": hyper if have_values else None, "params": {}}
        )
        g["params"][fqn] = p
    return list(groups.values())


def _ranks_that_wrote(directory: str, marker: dict) -> int | None:
    if marker.get("world_size"):
        return int(marker["world_size"])
    ranks = {int(m.group(1)) for n in os.listdir(directory) if (m := _RANK_FILE.match(n))}
    return len(ranks) or None


def inspect_checkpoint(
    directory: str, *, read_hyperparameters: bool = True, verify_checksums: bool = False
) -> dict:
    """What the checkpoint in ``directory`` holds, after checking it is whole.

    The result (``--json`` of the command line prints it):

    ```text
    {"directory": str, "status": "complete" | "dcp", "detail": line,
     "checksums_verified": bool, "ranks": int | None, "files": int,
     "bytes_on_disk": int,
     "optimizers": {prefix: {
         "format": 3 | 2 | 1 | "torch", "params": int, "with_state": int,
         "state_bytes": int,
         "groups": [{"hyperparameters": {name: value} | None,
                     "params": {fqn: {"state": {key: TENSOR},
                                      "scalars": {key: value}}}}]}},
     "other": {top_key: {"tensors": int, "bytes": int,
                         "entries": {name: TENSOR}}}}
    TENSOR = {"dtype": str, "shape": [int], "bytes": int}  (None each for
             a non-tensor item)
    ```

    ``status`` is ``"complete"`` (written by ``save_checkpoint``) or
    ``"dcp"`` (plain ``dcp.save``, no completion marker); ``other`` holds
    the entries that are not optimizer state (a model's, under ``"model"``).
    Params are listed in the order ``.metadata`` holds them (the model's).
    ``hyperparameters`` is None when ``read_hyperparameters=False`` (only
    ``.metadata`` is read; params then form one group).

    Args:
        directory: The checkpoint directory.
        read_hyperparameters: Also read the hyperparameters (not only
            ``.metadata``).
        verify_checksums: Verify every item's CRC32 (when the save wrote
            them; ``checksums_verified`` says whether it did).

    Returns:
        The description above.

    Raises:
        FileNotFoundError: No checkpoint there.
        IncompleteCheckpointError: The save never finished.
        CorruptCheckpointError: Missing, truncated or replaced files, a
            checksum mismatch with ``verify_checksums``, an unreadable item.
        UnsafeCheckpointError: ``.metadata`` or an item asks for code.
        pickle.UnpicklingError: A ``.metadata`` that is not a pickle (or
            ``EOFError``).
    """
    path = os.path.abspath(os.fspath(directory))
    marker, status, detail, verified = _integrity(path, verify_checksums)
    md = safe_read_metadata(path)
    if not marker:
        errors = _shard_errors(path, md)
        if errors:
            raise CorruptCheckpointError("\n  ".join(errors[:20]))
    found, wanted, others = _collect(md)
    values = _read_items(path, list(wanted)) if read_hyperparameters else None
    _fill(found, wanted, values)
    for entry in found.values():
        params = [p for g in entry["groups"] for p in g["params"].values()]
        entry["params"] = len(params)
        entry["with_state"] = sum(1 for p in params if p["state"] or p["scalars"])
        entry["state_bytes"] = sum(s["bytes"] for p in params for s in p["state"].values())
    files = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))]
    return {
        "directory": path,
        "status": status,
        "detail": detail,
        "checksums_verified": verified,
        "ranks": _ranks_that_wrote(path, marker),
        "files": len(files),
        "bytes_on_disk": sum(os.path.getsize(os.path.join(path, n)) for n in files),
        "optimizers": {k: found[k] for k in sorted(found)},
        "other": others,
    }
