"""Every module of the package imports on its own: an import cycle fails here, not in a user's job.

One fresh interpreter (same environment, the package's own directory first on PYTHONPATH)
imports torch and the torch.distributed modules the package uses, then forks one child per module
of src/mfsdp_optim (found by walking the tree, so a new module is covered without a test edit);
each child starts with no ``mfsdp_optim`` module loaded and imports exactly one, so the import
order is the one a user who imports that module first gets. The children's results come back as
one JSON line. An integration's implementation module (``mfsdp_optim.integrations._*``) may
instead raise the ImportError that says what to install, where its framework is missing; under
CI=true (which installs the trainers) it must import too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# located without importing it: this process must not run the package's imports either
_SPEC = importlib.util.find_spec("mfsdp_optim")
assert _SPEC is not None and _SPEC.origin is not None, "mfsdp_optim is not importable"
PACKAGE_DIR = os.path.dirname(os.path.abspath(_SPEC.origin))

# runs in the fresh interpreter: argv[1:] are the module names
_PROBE = r"""
import json, os, sys, traceback
import torch, torch.distributed, torch.distributed.tensor, torch.distributed.checkpoint  # shared
import torch.distributed.fsdp  # noqa: the heavy, package-independent part, paid once
assert not [m for m in sys.modules if m.split(".")[0] == "mfsdp_optim"], "loaded too early"
results = {}
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            msg = "ok" if name in sys.modules else "not in sys.modules after import"
        except ImportError as exc:
            integration = name.startswith("mfsdp_optim.integrations._")
            told = integration and "Install it: pip install" in str(exc)
            msg = f"missing framework: {exc}" if told else traceback.format_exc()
        except BaseException:
            msg = traceback.format_exc()
        os.write(write, msg.encode())
        os.close(write)
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    results[name] = b"".join(chunks).decode() or f"child died (wait status {status})"
print(json.dumps(results))
"""


def _modules() -> list[str]:
    names = []
    for base, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(base, os.path.dirname(PACKAGE_DIR))
        package = rel.replace(os.sep, ".")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            stem = f[: -len(".py")]
            names.append(package if stem == "__init__" else f"{package}.{stem}")
    return names


def test_the_walk_finds_every_layer():
    names = _modules()
    for expected in (
        "mfsdp_optim",
        "mfsdp_optim.stats._math",
        "mfsdp_optim.optim",
        "mfsdp_optim.checkpoint._table",
        "mfsdp_optim.checkpoint.__main__",
        "mfsdp_optim._infra.placement",
    ):
        assert expected in names, (expected, names)
    assert len(names) == len(set(names))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter():
    names = _modules()
    env = dict(os.environ)
    src = os.path.dirname(PACKAGE_DIR)
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names)
    tolerated = "missing framework:" if os.environ.get("CI") != "true" else "ok"
    failed = {
        name: msg for name, msg in results.items() if msg != "ok" and not msg.startswith(tolerated)
    }
    assert not failed, "\n\n".join(f"import {n} first:\n{m}" for n, m in failed.items())
