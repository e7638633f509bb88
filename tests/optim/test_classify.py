"""``classify_update``: an optimizer class's update kind found by stepping it, with evidence.

Every torch.optim class is classified as the package treats it (elementwise classes exact on
local shards on three layouts, Muon and Adafactor only on whole params, LBFGS and SparseAdam
refused); Prodigy reads across params (one instance over all params differs from one per
param) and is cross_param; a planted wrong declaration (Adafactor declared elementwise) is
reported unsafe, through the real spawned ranks of ``classify_update`` and through the CLI's
exit status. The sharded runs of the torch sweep use the suite's rank pool
(``classify_with``); the rest spawn ranks as a user's call does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _models import ELEMENTWISE_KWARGS

from mfsdp_optim.optim import Classification, classify_update
from mfsdp_optim.optim._kinds._classify import classify_with, trial
from mfsdp_optim.optim._kinds._kind_of import known_kind

KWARGS = {
    **ELEMENTWISE_KWARGS,
    "Muon": dict(lr=0.02, weight_decay=0.1),
    "Adafactor": dict(lr=0.01),
    "LBFGS": dict(lr=0.1),
    "SparseAdam": dict(lr=0.01),
}


def _pool_runner(ranks):
    def run(target, kwargs, layout, steps, kind):
        return ranks(4).run(trial, target, kwargs, layout, steps, kind)[0]

    return run


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_every_torch_class_is_classified_as_the_package_treats_it(ranks, name):
    cls = getattr(torch.optim, name)
    got = classify_with(_pool_runner(ranks), cls, KWARGS[name], steps=5)
    if name in ("LBFGS", "SparseAdam"):
        # refused by the package; in plain torch LBFGS needs a closure, SparseAdam sparse grads
        assert got.treated is None and got.kind is None and got.safe, got
        return
    assert got.kind == known_kind(cls) == got.treated and got.safe, str(got)
    if got.kind == "whole_param":  # the elementwise runs were tried and differ
        assert not any(r.get("exact") for r in got.evidence["elementwise"].values()), str(got)


def test_prodigy_reads_across_params():
    pytest.importorskip("pytorch_optimizer")
    got = classify_update("pytorch_optimizer.optimizer.prodigy:Prodigy", {"lr": 1.0})
    assert got.kind == "cross_param" and got.treated is None and got.safe, str(got)
    assert got.evidence["references"]["cross_param"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mfsdp_optim.optim",
            "classify",
            "pytorch_optimizer.optimizer.prodigy:Prodigy",
            "--kwargs",
            '{"lr": 1.0}',
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Prodigy: cross_param" in out.stdout and "treats it as: refused" in out.stdout


def test_a_planted_wrong_declaration_is_caught():
    """Adafactor declared elementwise: its factors read whole rows and columns, so the shards
    differ; ``classify_update`` (spawning its own 4 ranks) reports the declaration unsafe."""
    got = classify_update(
        torch.optim.Adafactor,
        {"lr": 0.01},
        steps=3,
        layouts=("1d-uneven-empty",),
        declared={torch.optim.Adafactor: "elementwise"},
    )
    assert isinstance(got, Classification)
    assert got.kind == "whole_param" and got.treated == "elementwise" and not got.safe
    assert "WRONG" in str(got) and "differs" in str(got)
    assert got.evidence["whole_param"]["1d-uneven-empty"]["exact"]


def test_the_cli_fails_on_an_unsafe_class():
    """A planted class that declares itself elementwise but reads the whole param."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mfsdp_optim.optim",
            "classify",
            "_planted:PlantedNormSGD",
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**__import__("os").environ, "PYTHONPATH": _pythonpath()},
    )
    assert out.returncode == 1, (out.stdout, out.stderr[-2000:])
    assert "WRONG: the package steps it as elementwise" in out.stdout


def _pythonpath() -> str:
    import os
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    return os.pathsep.join([here, *sys.path])
