"""``python -m mfsdp_optim.optim classify package.module:Class``: the command line over
``classify_update`` (``_kinds/_classify.py``).

Map: ``main`` parses the arguments, classifies the class and prints the evidence; its exit status
is 1 when the package would step the class faster than the evidence allows, else 0.
"""

from __future__ import annotations

import argparse
import json

from ._kinds._classify import DEFAULT_STEPS, classify_update

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m mfsdp_optim.optim classify package.module:Class [--kwargs JSON]``."""
    parser = argparse.ArgumentParser(prog="python -m mfsdp_optim.optim")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("classify", help="an optimizer class's update kind, with evidence")
    c.add_argument("target", help="package.module:Class")
    c.add_argument(
        "--kwargs", default="{}", help='constructor arguments as JSON, e.g. {"lr": 1e-3}'
    )
    c.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    result = classify_update(args.target, json.loads(args.kwargs), steps=args.steps)
    print(str(result))
    return 0 if result.safe else 1
