"""``python -m mfsdp_optim.checkpoint inspect DIR``: what a DCP optimizer checkpoint holds.

Reads the checkpoint's ``.metadata`` (FQNs, state keys, global shapes, dtypes) and only the small
pickled hyperparameter entries; no tensor data is read. Nothing is unpickled beyond an allow-list:
``.metadata`` through ``safe_read_metadata`` and the hyperparameter entries with
``torch.load(weights_only=True)`` (see ``_safe.py``), so inspecting an untrusted checkpoint runs
none of its code. An incomplete checkpoint (a save that never finished) is reported as such, with
exit status 3. Understands both layouts:
fsdp_dtensor (``<prefix>.state.<fqn>.<key>`` + ``<prefix>.param_to_group_meta.<fqn>.<name>``) and
torch's ``get_optimizer_state_dict`` (``<prefix>.state...`` + ``<prefix>.param_groups``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from ._safe import SafeFileSystemReader, SafeLoadPlanner, raise_unsafe, safe_read_metadata
from ._save import checkpoint_status

__all__ = ["inspect_checkpoint", "main"]


def _path_of(key: str, planner_data: dict | None) -> tuple:
    if planner_data and key in planner_data:
        return tuple(planner_data[key])
    return tuple(key.split("."))


def _read_bytes(directory: str, keys: list[str]) -> dict[str, Any]:
    if not keys:
        return {}
    import torch.distributed.checkpoint as dcp

    # top-level keys that already are DCP's flat keys: the default planner maps each to itself
    # and writes the unpickled value back into this dict
    target: dict[str, Any] = dict.fromkeys(keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        try:
            dcp.load(target, storage_reader=SafeFileSystemReader(directory),
                     planner=SafeLoadPlanner(), no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise_unsafe(exc)
            raise
    return target


def inspect_checkpoint(directory: str, *, read_hyperparameters: bool = True) -> dict:
    """``{prefix: {"layout", "params": {fqn: {"state": {key: {"dtype","shape"}},
    "hyperparameters": {...}}}}}`` for every optimizer state dict found in the checkpoint."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    status, message = checkpoint_status(directory)
    if status in ("missing", "incomplete"):
        raise FileNotFoundError(message)
    md = safe_read_metadata(directory)
    out: dict[str, dict] = {}
    byte_keys: dict[str, tuple] = {}
    for key, item in md.state_dict_metadata.items():
        path = _path_of(key, md.planner_data)
        if len(path) >= 3 and path[-3] in ("state", "param_to_group_meta", "param_groups"):
            prefix, kind, fqn, name = ".".join(map(str, path[:-3])), path[-3], path[-2], path[-1]
        else:
            continue
        entry = out.setdefault(prefix, {"layout": "fsdp_dtensor", "params": {}})
        if kind == "param_groups":  # torch layout: <prefix>.param_groups.<index>.<name>
            entry["layout"] = "torch (get_optimizer_state_dict)"
            byte_keys[key] = (prefix, int(fqn), str(name))
            continue
        param = entry["params"].setdefault(str(fqn), {"state": {}, "hyperparameters": {}})
        if kind == "state":
            if isinstance(item, BytesStorageMetadata):
                param["state"][str(name)] = {"dtype": "object", "shape": None}
            else:
                param["state"][str(name)] = {
                    "dtype": str(item.properties.dtype).removeprefix("torch."),
                    "shape": list(item.size),
                }
        else:
            param["hyperparameters"][str(name)] = None
            byte_keys[key] = (prefix, str(fqn), str(name))
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    values = _read_bytes(directory, list(byte_keys)) if read_hyperparameters else {}
    for key, (prefix, fqn, name) in byte_keys.items():
        value = values.get(key)
        if isinstance(fqn, int):
            groups.setdefault((prefix, fqn), {})[name] = value
        else:
            out[prefix]["params"][fqn]["hyperparameters"][name] = value
    for (prefix, _), group in sorted(groups.items()):
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for p in group.get("params") or []:
            param = out[prefix]["params"].setdefault(str(p), {"state": {}, "hyperparameters": {}})
            param["hyperparameters"] = hyper
    return out


def _fmt(value: Any) -> str:
    return repr(value) if not isinstance(value, float) else f"{value:g}"


def _render(directory: str, found: dict) -> str:
    if not found:
        return (f"{directory}: a finished DCP checkpoint, but it holds no optimizer state "
                "(no '<prefix>.state.<fqn>.<key>' entries)")
    lines = []
    for prefix, entry in found.items():
        params = entry["params"]
        with_state = sum(1 for p in params.values() if p["state"])
        lines.append(f"[{prefix or '<root>'}] layout {entry['layout']}: {len(params)} params, "
                     f"{with_state} with state")
        for fqn in sorted(params):
            p = params[fqn]
            lines.append(f"  {fqn}")
            for key in sorted(p["state"]):
                s = p["state"][key]
                shape = "scalar" if s["shape"] in ([], None) else "x".join(map(str, s["shape"]))
                lines.append(f"    {key:<16} {s['dtype']:<9} {shape}")
            if not p["state"]:
                lines.append("    (no state: never stepped when saved)")
            if p["hyperparameters"]:
                hp = " ".join(f"{k}={_fmt(v)}" for k, v in sorted(p["hyperparameters"].items()))
                lines.append(f"    hyperparameters: {hp}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mfsdp_optim.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="list FQNs, state keys, shapes, dtypes, hyperparameters")
    ins.add_argument("directory")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.add_argument("--no-values", action="store_true",
                     help="list hyperparameter names only (read nothing but .metadata)")
    args = parser.parse_args(argv)
    status, message = checkpoint_status(args.directory)
    if status == "incomplete":
        print(f"error: {message}", file=sys.stderr)
        return 3
    try:
        found = inspect_checkpoint(args.directory, read_hyperparameters=not args.no_values)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a corrupt or foreign .metadata
        print(f"error: {args.directory}: cannot read the checkpoint metadata "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(found, indent=2, default=repr))
    else:
        if status == "complete":
            print(message)
        print(_render(args.directory, found))
    return 0
