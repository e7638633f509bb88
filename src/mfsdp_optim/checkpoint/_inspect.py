"""``python -m mfsdp_optim.checkpoint inspect DIR``: what a DCP optimizer checkpoint holds, and
whether it is whole.

Exit status, for every path through the command: **0** the checkpoint is whole and was listed;
**2** bad input (no such directory, not a DCP checkpoint, a ``.metadata`` that is not DCP's or
asks the unpickler for code, bad arguments); **3** incomplete or damaged (a save that never
finished, a missing or truncated shard, a ``.metadata`` that differs from the one the save wrote,
a checksum mismatch with ``--verify``, an item that cannot be read).

Before anything is listed: with this package's completion marker, every file's size and the
SHA-256 of ``.metadata`` are checked against the marker (and, with ``--verify``, every item's
CRC32); without it (plain ``dcp.save``), every byte range ``.metadata`` points at must lie inside
an existing file. Nothing is unpickled beyond an allow-list (``.metadata`` through
``safe_read_metadata``, the small non-tensor items through ``torch.load(weights_only=True)``),
and no tensor data is read. Understands fsdp_dtensor format 3 (ONE ``param_to_group_meta`` item,
the tagged tuple of a ``GroupMetaTable``), format 2 (one ``param_to_group_meta`` leaf per FQN),
0.1.0's format 1 (one item per hyperparameter) and torch's ``get_optimizer_state_dict`` layout
(``param_groups``). With ``--no-values`` a format-3 checkpoint lists only the params that have
state tensors (the others are named only inside the table, which is then not read).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import sys
import warnings
from typing import Any

from ._safe import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    raise_unsafe,
    safe_read_metadata,
)
from ._save import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    check_checkpoint,
    checkpoint_status,
)

__all__ = ["inspect_checkpoint", "main"]

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


def _integrity(directory: str, verify: bool) -> tuple[dict, str]:
    """The marker (``{}`` without one) and a line saying what was checked; raises
    FileNotFoundError, IncompleteCheckpointError or CorruptCheckpointError."""
    status, message = checkpoint_status(directory)
    if status == "missing":
        raise FileNotFoundError(message)
    if status == "incomplete":
        raise IncompleteCheckpointError(message)
    if status == "complete":
        marker = check_checkpoint(directory, verify_checksums=verify)
        checked = "file sizes and .metadata SHA-256" + (
            " and every item's CRC32" if verify and marker.get("checksums") else ""
        )
        return marker, f"{message}; checked {checked} against the marker"
    return {}, f"{message}; checked that every item lies inside an existing file"


def _tensor_entry(item) -> dict:
    size = list(item.size)
    dtype = str(item.properties.dtype).removeprefix("torch.")
    itemsize = getattr(item.properties.dtype, "itemsize", 0)
    return {"dtype": dtype, "shape": size, "bytes": math.prod(size) * itemsize}


def _collect(md) -> tuple[dict[str, dict], dict[str, tuple]]:
    """Per prefix the params' tensor entries, and the non-tensor keys to read with their role."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    found: dict[str, dict] = {}
    wanted: dict[str, tuple] = {}
    for key, item in md.state_dict_metadata.items():
        parts = _split(_path_of(key, md.planner_data))
        if parts is None:
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
    return found, wanted


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
    from ._table import as_table

    try:
        table = as_table(value, key)
    except ValueError as exc:
        raise CorruptCheckpointError(str(exc)) from None
    for fqn, (hyper, scalars) in table.leaves():
        p = entry["params"].setdefault(fqn, {"state": {}, "scalars": {}, "leaf": None, "hyper": {}})
        p["hyper"] = dict(hyper)
        p["scalars"].update({k: v for k, v, _ in scalars})


def _groups(params: dict[str, dict], have_values: bool) -> list[dict]:
    """Params grouped by equal hyperparameters, in first-seen order of sorted FQNs."""
    groups: dict[str, dict] = {}
    for fqn in sorted(params):
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
    """What the checkpoint in ``directory`` holds, after checking it is whole:

    ```text
    {"directory", "status": line, "ranks": int | None, "files": int, "bytes_on_disk": int,
     "optimizers": {prefix: {"format": 3 | 2 | 1 | "torch", "params": int, "with_state": int,
                             "state_bytes": int,
                             "groups": [{"hyperparameters": {name: value} | None,
                                         "params": {fqn: {"state": {key: {"dtype", "shape",
                                                                          "bytes"}},
                                                          "scalars": {key: value}}}}]}}}
    ```

    ``hyperparameters`` is None when ``read_hyperparameters=False`` (only ``.metadata`` is read;
    params then form one group).

    Args:
        directory: The checkpoint directory.
        read_hyperparameters: Also read the hyperparameters (not only ``.metadata``).
        verify_checksums: Verify every file's checksum.

    Returns:
        The description above.

    Raises:
        FileNotFoundError: No checkpoint there.
        IncompleteCheckpointError: The save never finished.
        CorruptCheckpointError: Missing, truncated or replaced files, a checksum mismatch with
            ``verify_checksums``, an unreadable item.
        UnsafeCheckpointError: ``.metadata`` or an item asks for code.
        pickle.UnpicklingError: A ``.metadata`` that is not a pickle (or ``EOFError``).
    """
    path = os.path.abspath(os.fspath(directory))
    marker, status = _integrity(path, verify_checksums)
    md = safe_read_metadata(path)
    if not marker:
        errors = _shard_errors(path, md)
        if errors:
            raise CorruptCheckpointError("\n  ".join(errors[:20]))
    found, wanted = _collect(md)
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
        "ranks": _ranks_that_wrote(path, marker),
        "files": len(files),
        "bytes_on_disk": sum(os.path.getsize(os.path.join(path, n)) for n in files),
        "optimizers": {k: found[k] for k in sorted(found)},
    }


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _layout_name(fmt: Any) -> str:
    return {
        3: "fsdp_dtensor (format 3)",
        2: "fsdp_dtensor (format 2)",
        1: "fsdp_dtensor (format 1, mfsdp_optim 0.1.0)",
        "torch": "torch (get_optimizer_state_dict)",
    }[fmt]


def _render(report: dict) -> str:
    lines = [report["status"]]
    if not report["optimizers"]:
        lines.append("it holds no optimizer state (no '<prefix>.state.<fqn>.<key>' entries)")
    for prefix, entry in report["optimizers"].items():
        lines.append(
            f"[{prefix or '<root>'}] layout {_layout_name(entry['format'])}: "
            f"{entry['params']} params, {entry['with_state']} with state, "
            f"{len(entry['groups'])} group(s), {_size(entry['state_bytes'])} of state "
            "tensors"
        )
        for gi, group in enumerate(entry["groups"]):
            hyper = group["hyperparameters"]
            if hyper is None:
                shown = "hyperparameters not read (--no-values)"
            else:
                shown = " ".join(f"{k}={_fmt(v)}" for k, v in sorted(hyper.items())) or "(none)"
            lines.append(f"  group {gi} ({len(group['params'])} params): {shown}")
            width = max(len(f) for f in group["params"])
            for fqn, p in group["params"].items():
                state = ", ".join(
                    f"{k} {s['dtype']} {'x'.join(map(str, s['shape'])) or 'scalar'}"
                    for k, s in sorted(p["state"].items())
                )
                scalars = ", ".join(
                    f"{k}={_fmt(v) if v is not None else '(not read)'}"
                    for k, v in sorted(p["scalars"].items())
                )
                body = "; ".join(x for x in (state, scalars) if x) or (
                    "no state (never stepped when saved)"
                )
                lines.append(f"    {fqn:<{width}}  {body}")
    ranks = report["ranks"]
    lines.append(
        f"totals: {sum(e['params'] for e in report['optimizers'].values())} params, "
        f"{_size(sum(e['state_bytes'] for e in report['optimizers'].values()))} of "
        f"state tensors; {report['files']} files, {_size(report['bytes_on_disk'])} on "
        f"disk; written by {ranks if ranks is not None else 'an unknown number of'} "
        "rank(s)"
    )
    return "\n".join(lines)


def _fail(code: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0 whole, 2 bad input, 3 incomplete or
    damaged)."""
    parser = argparse.ArgumentParser(
        prog="python -m mfsdp_optim.checkpoint",
        description="Inspect a torch.distributed.checkpoint optimizer checkpoint. Exit status: "
        "0 whole, 2 bad input, 3 incomplete or damaged.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect", help="check a checkpoint and list its groups, params, shapes, dtypes and totals"
    )
    ins.add_argument("directory")
    ins.add_argument("--json", action="store_true", help="print one JSON document")
    ins.add_argument(
        "--no-values",
        action="store_true",
        help="read nothing but .metadata (hyperparameters and steps not shown)",
    )
    ins.add_argument(
        "--verify", action="store_true", help="also check every item's CRC32 (reads every byte)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    try:
        report = inspect_checkpoint(
            args.directory, read_hyperparameters=not args.no_values, verify_checksums=args.verify
        )
    except FileNotFoundError as exc:
        return _fail(2, str(exc))
    except UnsafeCheckpointError as exc:
        return _fail(2, f"{args.directory}: {exc}")
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        return _fail(3, str(exc))
    except (pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
        return _fail(
            3, f"{args.directory}: .metadata is damaged or not DCP's ({type(exc).__name__}: {exc})"
        )
    if args.json:
        print(json.dumps(report, indent=1, default=repr))
    else:
        print(_render(report))
    return 0
