"""The integration modules import without their frameworks (torch stays the only hard
dependency): ``import mfsdp_optim`` loads no trainer, each ``mfsdp_optim.integrations.<name>``
imports with its framework blocked, and its first use raises an ImportError that says what to
install. Each case runs in a fresh interpreter whose ``sys.modules`` blocks the framework."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

_PROBE = r"""
import importlib, json, sys
blocked, module, name = sys.argv[1], sys.argv[2], sys.argv[3]
sys.modules[blocked] = None  # import blocked -> ImportError, as if not installed
import mfsdp_optim
loaded = sorted({m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
                & {"lightning", "accelerate", "torchtitan"})
mod = importlib.import_module(module)
try:
    getattr(mod, name)
    error = None
except ImportError as exc:
    error = str(exc)
print(json.dumps({"loaded": loaded, "error": error, "all": mod.__all__}))
"""

CASES = [
    ("lightning", "mfsdp_optim.integrations.lightning", "GradNormCallback"),
    ("torchtitan", "mfsdp_optim.integrations.torchtitan", "FullyShardedOptimizersContainer"),
    ("torchtitan", "mfsdp_optim.integrations.torchtitan", "FullyShardedTrainer"),
    ("accelerate", "mfsdp_optim.integrations.accelerate", "prepare"),
]


@pytest.mark.parametrize(("blocked", "module", "name"), CASES)
def test_imports_without_its_framework_and_says_what_to_install(blocked, module, name):
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, blocked, module, name],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out  # import mfsdp_optim loaded no trainer
    assert name in out["all"]
    assert out["error"] is not None and "pip install 'mfsdp-optim[trainers]'" in out["error"]
    assert blocked in out["error"], out["error"]


def test_an_unknown_name_is_an_attribute_error():
    import mfsdp_optim.integrations.lightning as lightning

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        lightning.Nope  # noqa: B018
