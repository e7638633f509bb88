"""The third-party conformance run: every optimizer class of pytorch-optimizer's
``get_supported_optimizers()``, lion-pytorch's Lion and torchao's low-bit AdamW under the
wrapper on 4 CPU gloo ranks, on three layouts, against the same class on the unsharded params
fed the very same grads (``trial``, from ``mfsdp_optim.optim.seam``).

    python scripts/conformance.py            # the whole run: docs/conformance.json + the table
    python scripts/conformance.py --kinds    # also each class on local shards and whole params
                                             # (the evidence behind _registry.py's entries)
    python scripts/conformance.py --render   # the table in docs/optimizers.md from the json
                                             # (classes registered since: their local-shard
                                             # runs as the package column, marked)
    python scripts/conformance.py --keep-kinds  # the package column only, evidence kept

``nox -s conformance`` runs the first. The table in docs/optimizers.md is rendered from the json
(``tests/optim/test_conformance.py`` checks that it matches).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "docs" / "conformance.json"
PARTIAL = Path("/tmp") / "mfsdp_conformance_partial.json"
DOC = ROOT / "docs" / "optimizers.md"
START, END = "<!-- conformance:start -->", "<!-- conformance:end -->"
STEPS = 5
# constructor arguments besides lr for classes that require them
EXTRA = {
    "bsam": {"num_data": 10},
    "ranger21": {"num_iterations": 100},
    # the step-size-free classes are meant for lr=1: with 1e-2 their d barely moves in 5 steps
    **{n: {"lr": 1.0} for n in ("prodigy", "dadaptadam", "dadaptsgd", "dadaptadagrad")},
    **{n: {"lr": 1.0} for n in ("dadaptadan", "dadaptlion")},
}


def targets() -> list[tuple[str, str, dict]]:
    """(row name, "module:Class", kwargs) of every class of the installed libraries."""
    out = []
    try:
        import pytorch_optimizer as po

        for name in po.get_supported_optimizers():
            cls = po.load_optimizer(name)
            out.append(
                (name, f"{cls.__module__}:{cls.__qualname__}", {"lr": 1e-2, **EXTRA.get(name, {})})
            )
    except ImportError:
        pass
    try:
        import lion_pytorch

        out.append(("lion-pytorch Lion", f"{lion_pytorch.Lion.__module__}:Lion", {"lr": 1e-3}))
    except ImportError:
        pass
    try:
        import torchao.optim as ao

        for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
            if hasattr(ao, name):
                cls = getattr(ao, name)
                out.append(
                    (f"torchao {name}", f"{cls.__module__}:{cls.__qualname__}", {"lr": 1e-3})
                )
    except ImportError:
        pass
    return out


_POOL: list = [None]  # the pool in use (replaced after a crash)


def run_one(pool, target: str, kwargs: dict, kinds: tuple) -> dict:
    """One class: the single-process references, then each kind on each layout."""
    from mfsdp_optim.optim.seam import LAYOUTS, load_class, references, trial

    cls = load_class(target)
    row: dict = {"references": references(cls, kwargs, STEPS)}
    if not row["references"].get("runs"):
        return row
    for kind in kinds:
        row[kind or "package"] = {}
        for layout in LAYOUTS:
            try:
                got = pool.run(trial, target, kwargs, layout, STEPS, kind, timeout=120)
                row[kind or "package"][layout] = got[0]
            except Exception as exc:  # noqa: BLE001 - a hang or a crash is a result too
                from _ranks import get_pool

                row[kind or "package"][layout] = {"error": "hang or crash: " + str(exc)[-300:]}
                # a fresh pool: a gloo timeout leaves the old group unusable
                if pool.alive:
                    pool.shutdown()
                pool = get_pool(4)
                _POOL[0] = pool
    return row


def _whole_evidence(pool, row: dict) -> None:
    """``row["whole_param"]``: the package column where the package stepped it on whole
    params, else a whole-param run where the local-shard one differs."""
    package = row.get("package", {})
    if not package:
        return
    if all(r.get("kind") == "whole_param" for r in package.values()):
        row["whole_param"] = package
        return
    local = row.get("elementwise", {})
    if local and not all(r.get("exact") for r in local.values()):
        from mfsdp_optim.optim.seam import load_class  # noqa: F401 - rows hold targets

        target, kwargs = row["target"], row["kwargs"]
        extra = run_one(pool, target, kwargs, ("whole_param",))
        if "whole_param" in extra:
            row["whole_param"] = extra["whole_param"]


def _package_kind(row: dict) -> str | None:
    """The kind the package steps the row's class as today, built with the row's arguments
    (None: refused, unknown to this install, or not constructible)."""
    import warnings

    import torch

    from mfsdp_optim.optim.seam import kind_of, load_class

    try:
        cls = load_class(row["target"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kind_of(cls([torch.nn.Parameter(torch.zeros(4, 3))], **row["kwargs"]), {})
    except Exception:  # noqa: BLE001 - refused or not constructible: nothing to copy
        return None


def _as_registered_now(row: dict) -> None:
    """A class registered elementwise after its package column was run (on whole params, as
    an unknown class then) gets its local-shard runs as the package column: the same trial
    (the registry and a declaration both give the engine the elementwise kind), marked. Only
    where the package steps it elementwise today with the row's arguments (a registered class
    whose group holds a value outside its default options takes the whole-param path)."""
    package, local = row.get("package", {}), row.get("elementwise", {})
    if not package or not local:
        return
    if _package_kind(row) == "elementwise" and any(
        r.get("kind") != "elementwise" for r in package.values()
    ):
        row["package"] = {k: {**v, "kind": "elementwise"} for k, v in local.items()}
        row["package_from"] = "the elementwise runs (registered after the package run)"


def verdict(row: dict) -> tuple[str, str]:
    """(how the package steps it, the result) for the table."""
    refs = row["references"]
    if not refs.get("runs"):
        return "-", "plain torch raises with lr only: " + refs["error"][:90]
    runs = row.get("package", {})
    refused = [r["refused"] for r in runs.values() if "refused" in r]
    if refused:
        return "refused", refused[0].split(":", 1)[-1].strip()[:120]
    kinds = {r.get("kind") for r in runs.values()}
    kind = "/".join(sorted(k for k in kinds if k))
    if refs.get("random"):
        return kind, "draws random numbers: not comparable with one unsharded run"
    errors = [r["error"] for r in runs.values() if "error" in r]
    if errors:
        return kind, "raises: " + errors[0][:100]
    if all(r.get("exact") for r in runs.values()):
        return kind, "bit for bit on every layout"
    worst = max(r.get("max_diff", 0.0) for r in runs.values())
    return kind, f"DIFFERS (max abs diff {worst:.2g})"


def render(data: dict) -> str:
    lines = [
        START,
        f"Last run: {data['date']}, {data['versions']}, {data['steps']} steps on each of "
        f"{', '.join(data['layouts'])}, 4 CPU gloo ranks.",
        "",
        "| class | stepped as | result |",
        "| --- | --- | --- |",
    ]
    for name, row in data["rows"].items():
        kind, result = verdict(row)
        lines.append(f"| {name} | {kind} | {result.replace('|', '/')} |")
    lines.append(END)
    return "\n".join(lines)


def write_doc(data: dict) -> None:
    text = DOC.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + render(data) + tail)


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", action="store_true")
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument("--resume", action="store_true", help="reuse the rows of a cut run")
    parser.add_argument(
        "--keep-kinds",
        action="store_true",
        help="rerun only the package column; keep the recorded per-kind evidence",
    )
    args = parser.parse_args()
    if args.render:
        data = json.loads(JSON.read_text())
        for row in data["rows"].values():
            _as_registered_now(row)  # classes registered since the run (marked in the row)
        JSON.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
        write_doc(data)
        return 0
    import os

    import torch
    from _ranks import get_pool

    from mfsdp_optim.optim.seam import LAYOUTS

    # the whole-param evidence of a class the package steps on whole params is its package
    # column (the same trial); other classes get it only where elementwise differs
    kinds = (None, "elementwise") if args.kinds else (None,)
    pool = get_pool(4)
    rows = {}
    start = time.monotonic()
    only = set(filter(None, args.only.split(",")))
    old_rows = json.loads(JSON.read_text())["rows"] if args.keep_kinds else {}
    done = json.loads(PARTIAL.read_text()) if args.resume and PARTIAL.exists() else {}
    for name, target, kwargs in targets():
        if only and name not in only:
            continue
        if name in done:
            rows[name] = done[name]
            continue
        t = time.monotonic()
        rows[name] = {"target": target, "kwargs": kwargs, **run_one(pool, target, kwargs, kinds)}
        pool = _POOL[0] or pool
        if args.kinds:
            _whole_evidence(pool, rows[name])
            pool = _POOL[0] or pool
        if args.keep_kinds and name in old_rows:
            for kind in ("elementwise", "whole_param"):
                if kind in old_rows[name]:
                    rows[name][kind] = old_rows[name][kind]
        print(f"{name}: {verdict(rows[name])} ({time.monotonic() - t:.1f} s)", flush=True)
        PARTIAL.write_text(json.dumps(rows, default=str) + "\n")
    # the package columns of this run are what the package did: nothing is copied into them
    # (``_as_registered_now`` is for --render, after a registry change)
    versions = [f"torch {torch.__version__}"]
    for mod in ("pytorch_optimizer", "lion_pytorch", "torchao"):
        try:
            from importlib.metadata import version

            versions.append(f"{mod.replace('_', '-')} {version(mod.replace('_', '-'))}")
        except Exception:  # noqa: BLE001
            versions.append(f"{mod} missing")
    data = {
        "date": datetime.date.today().isoformat(),
        "versions": ", ".join(versions),
        "steps": STEPS,
        "layouts": list(LAYOUTS),
        "seconds": time.monotonic() - start,
        "cores": os.cpu_count(),
        "rows": rows,
    }
    if not only:
        JSON.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
        write_doc(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
