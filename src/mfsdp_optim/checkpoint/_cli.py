"""``python -m mfsdp_optim.checkpoint inspect DIR``: the command line over ``inspect_checkpoint``.

Map: ``main`` parses arguments, runs the check and maps each outcome to an exit status (0 whole,
2 bad input, 3 incomplete or damaged, 4 ``--verify`` found nothing to verify); ``_select``
applies ``--filter`` / ``--limit``; ``_collapse`` folds repeated layers into one line;
``_render`` writes the text report; ``_emit`` prints it and ends quietly on a closed pipe.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import pickle
import re
import sys
from typing import Any

from ._errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError
from ._inspect_checkpoint import inspect_checkpoint

__all__ = ["main"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_DAMAGED, EXIT_NOTHING_VERIFIED = 0, 2, 3, 4
DEFAULT_LIMIT = 40  # lines of params per optimizer (text); --limit 0 shows all

EPILOG = """\
examples:
  python -m mfsdp_optim.checkpoint inspect ckpt/step_100
  python -m mfsdp_optim.checkpoint inspect ckpt/step_100 --verify
  python -m mfsdp_optim.checkpoint inspect ckpt/step_100 --filter '*.attn.*'
  python -m mfsdp_optim.checkpoint inspect ckpt/step_100 --limit 0 --expand
  python -m mfsdp_optim.checkpoint inspect ckpt/step_100 --json | jq .status

exit status:
  0  the checkpoint is whole and was listed
  2  bad input: no such directory, not a DCP checkpoint, a .metadata that is
     not DCP's or asks the unpickler for code, bad arguments
  3  incomplete or damaged: a save that never finished, a missing or
     truncated file, a checksum mismatch, an item that cannot be read
  4  --verify, but the checkpoint has no checksums (plain dcp.save, or
     save_checkpoint(checksums=False)): listed, nothing verified
"""


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


LAYOUTS = {
    3: "fsdp_dtensor (format 3)",
    2: "fsdp_dtensor (format 2)",
    1: "fsdp_dtensor (format 1, mfsdp_optim 0.1.0)",
    "torch": "torch (get_optimizer_state_dict)",
}


def _tensor(t: dict) -> str:
    if t["dtype"] is None:
        return "non-tensor item"
    return f"{t['dtype']} {'x'.join(map(str, t['shape'])) or 'scalar'}"


def _param_body(p: dict) -> str:
    state = ", ".join(f"{k} {_tensor(s)}" for k, s in sorted(p["state"].items()))
    scalars = ", ".join(
        f"{k}={_fmt(v) if v is not None else '(not read)'}" for k, v in sorted(p["scalars"].items())
    )
    return "; ".join(x for x in (state, scalars) if x) or "no state (never stepped when saved)"


_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component that is a number


def _span(values: list[int]) -> str:
    """``0..99`` for a run, ``0,2,5`` otherwise (at most 6 shown)."""
    uniq = sorted(set(values))
    if len(uniq) > 1 and uniq == list(range(uniq[0], uniq[-1] + 1)):
        return f"{uniq[0]}..{uniq[-1]}"
    shown = ",".join(map(str, uniq[:6]))
    return shown + (",..." if len(uniq) > 6 else "")


def _collapse(rows: list[tuple[str, str]], min_repeats: int = 3) -> list[tuple[str, str, int]]:
    """``(name, body)`` rows -> ``(shown name, body, count)``: names that differ only in their
    numbered components (``layers.0.w``, ``layers.1.w``, ...) and have the same body become one
    row ``layers.{0..99}.w`` when at least ``min_repeats`` of them do; order of first appearance."""
    buckets: dict[tuple[str, str], list[str]] = {}
    for name, body in rows:
        buckets.setdefault((_NUMBER.sub("#", name), body), []).append(name)
    out = []
    for (pattern, body), names in buckets.items():
        if len(names) < min_repeats or "#" not in pattern:
            out += [(n, body, 1) for n in names]
            continue
        columns = list(zip(*(_NUMBER.findall(n) for n in names), strict=True))
        parts = pattern.split("#")
        shown = parts[0]
        for column, tail in zip(columns, parts[1:], strict=True):
            values = [int(v) for v in column]
            shown += str(values[0]) if len(set(values)) == 1 else "{" + _span(values) + "}"
            shown += tail
        out.append((shown, body, len(names)))
    return out


def _select(names: list[str], pattern: str | None) -> list[str]:
    return [n for n in names if pattern is None or fnmatch.fnmatchcase(n, pattern)]


def _lines(rows: list[tuple[str, str, int]], limit: int, indent: str, what: str) -> list[str]:
    """The rows as aligned lines, at most ``limit`` of them (0: all) and a line for the rest."""
    shown = rows if limit <= 0 else rows[:limit]
    width = max((len(r[0]) for r in shown), default=0)
    out = [
        f"{indent}{name:<{width}}  {body}" + (f"  (x{count})" if count > 1 else "")
        for name, body, count in shown
    ]
    left = sum(r[2] for r in rows[len(shown) :])
    if left:
        out.append(f"{indent}... {left} more {what} (--limit 0 shows all, --filter GLOB selects)")
    return out


def _render(report: dict, args: argparse.Namespace) -> str:
    lines = [report["detail"]]
    collapse = not args.expand
    if not report["optimizers"]:
        lines.append("it holds no optimizer state (no '<prefix>.state.<fqn>.<key>' entries)")
    for prefix, entry in report["optimizers"].items():
        lines.append(
            f"[{prefix or '(top level)'}] layout {LAYOUTS[entry['format']]}: "
            f"{entry['params']} params, {entry['with_state']} with state, "
            f"{len(entry['groups'])} group(s), {_size(entry['state_bytes'])} of state tensors"
        )
        left = args.limit  # lines still to show in this optimizer (0: no limit)
        for gi, group in enumerate(entry["groups"]):
            if args.limit > 0 and left <= 0:
                rest = entry["groups"][gi:]
                lines.append(
                    f"  ... {len(rest)} more group(s), "
                    f"{sum(len(g['params']) for g in rest)} params (--limit 0 shows all)"
                )
                break
            hyper = group["hyperparameters"]
            if hyper is None:
                shown = "hyperparameters not read (--no-values)"
            else:
                shown = " ".join(f"{k}={_fmt(v)}" for k, v in sorted(hyper.items())) or "(none)"
            lines.append(f"  group {gi} ({len(group['params'])} params): {shown}")
            names = _select(list(group["params"]), args.filter)
            rows = [(n, _param_body(group["params"][n])) for n in names]
            folded = _collapse(rows) if collapse else [(n, b, 1) for n, b in rows]
            if args.filter is not None:
                lines.append(f"    {len(names)} of {len(group['params'])} match {args.filter!r}")
            lines += _lines(folded, left, "    ", "params")
            left -= len(folded)
    for top, other in report["other"].items():
        names = _select(list(other["entries"]), args.filter)
        lines.append(
            f"[{top or '(top level)'}] {len(other['entries'])} other entries (not optimizer "
            f"state), {other['tensors']} tensors, {_size(other['bytes'])}"
        )
        rows = [(n, _tensor(other["entries"][n])) for n in names]
        if args.filter is not None:
            lines.append(f"    {len(names)} of {len(other['entries'])} match {args.filter!r}")
        folded = _collapse(rows) if collapse else [(n, b, 1) for n, b in rows]
        lines += _lines(folded, args.limit, "    ", "entries")
    ranks = report["ranks"]
    lines.append(
        f"totals: {sum(e['params'] for e in report['optimizers'].values())} params, "
        f"{_size(sum(e['state_bytes'] for e in report['optimizers'].values()))} of "
        f"state tensors; {report['files']} files, {_size(report['bytes_on_disk'])} on "
        f"disk; written by {ranks if ranks is not None else 'an unknown number of'} "
        "rank(s)"
    )
    return "\n".join(lines)


def _emit(text: str) -> bool:
    """Print ``text``; False when the reader closed the pipe (``| head``), without a traceback."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout is gone: point it at devnull so the interpreter's final flush is quiet too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False
    return True


def _fail(code: int, kind: str, message: str, as_json: bool, directory: str | None) -> int:
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        status = {EXIT_BAD_INPUT: "bad_input", EXIT_DAMAGED: "damaged"}[code]
        doc = {
            "directory": directory,
            "status": status,
            "exit_code": code,
            "error": {"type": kind, "message": message},
        }
        _emit(json.dumps(doc, indent=1))
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mfsdp_optim.checkpoint",
        description="Check that a torch.distributed.checkpoint checkpoint is whole, then list "
        "its optimizer state (groups, params, shapes, dtypes) and its other entries (the "
        "model's). No tensor data is read.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="check a checkpoint and list what it holds",
        description="Check a checkpoint and list what it holds.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ins.add_argument("directory")
    ins.add_argument(
        "--json", action="store_true", help="print one JSON document (errors too, on stdout)"
    )
    ins.add_argument(
        "--no-values",
        action="store_true",
        help="read nothing but .metadata (hyperparameters and steps not shown)",
    )
    ins.add_argument(
        "--verify",
        action="store_true",
        help="also check every item's CRC32 (reads every byte); exit 4 when there are none",
    )
    ins.add_argument(
        "--filter", metavar="GLOB", help="list only names matching GLOB, e.g. 'layers.1.*'"
    )
    ins.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help=f"at most N lines of params per optimizer and of other entries (text default "
        f"{DEFAULT_LIMIT}, JSON default all; 0: all)",
    )
    ins.add_argument(
        "--expand", action="store_true", help="one line per param (no folding of repeated layers)"
    )
    return parser


def _limit_json(report: dict, args: argparse.Namespace) -> None:
    """``--filter`` / ``--limit`` on the JSON document: keep the selected params and entries."""
    limit = args.limit or 0
    for entry in report["optimizers"].values():
        kept = 0
        for group in entry["groups"]:
            names = _select(list(group["params"]), args.filter)
            if limit > 0:
                names = names[: max(limit - kept, 0)]
            kept += len(names)
            group["params"] = {n: group["params"][n] for n in names}
    for other in report["other"].values():
        names = _select(list(other["entries"]), args.filter)
        names = names[:limit] if limit > 0 else names
        other["entries"] = {n: other["entries"][n] for n in names}


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0 whole, 2 bad input, 3 incomplete or damaged,
    4 ``--verify`` with nothing to verify)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    if args.limit is not None and args.limit < 0:
        return _fail(EXIT_BAD_INPUT, "ValueError", "--limit must be >= 0", args.json, None)
    try:
        report = inspect_checkpoint(
            args.directory, read_hyperparameters=not args.no_values, verify_checksums=args.verify
        )
    except FileNotFoundError as exc:
        return _fail(EXIT_BAD_INPUT, "FileNotFoundError", str(exc), args.json, args.directory)
    except UnsafeCheckpointError as exc:
        msg = f"{args.directory}: {exc}"
        return _fail(EXIT_BAD_INPUT, "UnsafeCheckpointError", msg, args.json, args.directory)
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        return _fail(EXIT_DAMAGED, type(exc).__name__, str(exc), args.json, args.directory)
    except (pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
        msg = f"{args.directory}: .metadata is damaged or not DCP's ({type(exc).__name__}: {exc})"
        return _fail(EXIT_DAMAGED, type(exc).__name__, msg, args.json, args.directory)
    code = EXIT_OK
    if args.verify and not report["checksums_verified"]:
        code = EXIT_NOTHING_VERIFIED
        note = (
            f"--verify: nothing to verify: {report['directory']} has no checksums "
            "(written by plain dcp.save or save_checkpoint(checksums=False)); only file "
            "sizes and byte ranges were checked (exit status 4)"
        )
        print(f"warning: {note}", file=sys.stderr)
        report["verify"] = "nothing to verify"
    elif args.verify:
        report["verify"] = "verified"
    if args.json:
        _limit_json(report, args)
        report["exit_code"] = code
        _emit(json.dumps(report, indent=1, default=repr))
    else:
        if args.limit is None:
            args.limit = DEFAULT_LIMIT
        _emit(_render(report, args))
    return code
