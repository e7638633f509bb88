"""Shared fixtures: persistent gloo rank pools (see _ranks.py) and hypothesis profiles."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, Phase, settings

sys.path.insert(0, os.path.dirname(__file__))

from _cuda_rule import require_cuda_marker  # noqa: E402
from _ranks import get_pool, shutdown_pools  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("MFSDP_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    print_blob=True,
    # shrinking replays examples across rank pools of several sizes: minutes per failure on
    # 2 cores. CI reports the unshrunk example; use the "thorough" profile to shrink.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the rule sees every collected test
def pytest_collection_modifyitems(config, items):
    """Every test that touches CUDA is marked ``cuda`` (else collection fails: the rule is in
    ``_cuda_rule.py``); tests marked ``cuda`` are skipped without a CUDA device (``-m cuda``
    selects them all)."""
    import torch

    require_cuda_marker(items)

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line on the tests marked ``cuda`` (the GPU check's summary quotes it)."""
    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "cuda" in getattr(report, "keywords", {}) and report.when in ("call", "setup"):
                counts[outcome] = counts.get(outcome, 0) + 1
    if counts:
        parts = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        terminalreporter.write_line(f"tests marked cuda: {parts}")


@pytest.fixture
def ranks():
    """``ranks(world_size)`` -> a live RankPool; ``pool.run(fn, *args)`` runs fn on every rank;
    ``ranks(world_size, cuda=False)``: one whose ranks see no CUDA device."""
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
