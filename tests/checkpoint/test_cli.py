"""``python -m mfsdp_optim.checkpoint inspect`` on real checkpoints.

Map: ``_write`` trains a stack of ``Linear(4, 4)`` layers under FSDP2 on 2 gloo ranks and saves
``{"model", "optimizer"}`` with ``save_checkpoint`` or plain ``dcp.save``; the ``ckpts`` fixture
writes four (12 layers, the same through ``dcp.save``, the same with 4 writer threads, 1,000
layers = 2,000 params) once per module. Each test checks one CLI behaviour against what the
ranks saved (names, shapes, order).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys

import pytest
from _ranks import get_pool

from mfsdp_optim.checkpoint._cli import main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")


def _write(path: str, layers: int, plain: bool, threads: int = 1) -> dict:
    """On every rank: train one step, save; returns the model's names and shapes in order."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    fully_shard(model)
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), OptimizerConfig(), model_chunks=[model]
    )
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    msd = get_model_state_dict(model)
    state = {"model": msd, "optimizer": opt.sharded_state_dict()}
    if plain:
        dcp.save(state, checkpoint_id=path)
    else:
        save_checkpoint(state, path, thread_count=threads)
    return {
        "params": [name for name, _ in model.named_parameters()],
        "model": {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in msd.items()},
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    pool = get_pool(2)
    out = {}
    for name, layers, plain, threads in (
        ("small", 12, False, 1),
        ("plain", 12, True, 1),
        ("threads", 12, False, 4),
        ("big", 1000, False, 1),
    ):
        path = str(root / name)
        saved = pool.run(_write, path, layers, plain, threads, timeout=300.0)
        assert saved[0] == saved[1]
        out[name] = (path, saved[0])
    out["root"] = root
    return out


def _run(capsys, *argv):
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_model_entries_are_listed(ckpts, capsys):
    path, saved = ckpts["small"]
    code, out, _ = _run(capsys, path, "--json")
    report = json.loads(out)
    assert code == 0 and report["exit_code"] == 0
    model = report["other"]["model"]
    got = {k: (e["dtype"], e["shape"]) for k, e in model["entries"].items()}
    assert got == {k: tuple(v) for k, v in saved["model"].items()}
    assert model["tensors"] == 24 and model["bytes"] == 12 * (16 + 4) * 4
    code, out, _ = _run(capsys, path, "--expand")
    assert code == 0
    assert "[model] 24 other entries (not optimizer state), 24 tensors, 960 B" in out, out
    assert "    11.bias    float32 4" in out, out


@pytest.mark.parametrize("name", ["small", "threads", "plain"])
def test_params_in_model_order(ckpts, capsys, name):
    """In model order whatever order DCP's writer finished its items in: several writer threads
    report them as they complete (and on a machine with CUDA, one thread reports them sorted by
    size); ``.metadata`` lists the keys as ``dcp.save`` does, in the state dict's order."""
    from torch.distributed.checkpoint import FileSystemReader

    path, saved = ckpts[name]
    keys = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    plain = list(FileSystemReader(ckpts["plain"][0]).read_metadata().state_dict_metadata)
    assert keys == plain
    code, out, _ = _run(capsys, path, "--json")
    groups = json.loads(out)["optimizers"]["optimizer"]["groups"]
    assert [n for g in groups for n in g["params"]] == saved["params"]  # 0, 1, 2, ..., 10, 11
    code, out, _ = _run(capsys, path, "--expand")
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert listed[: len(saved["params"])] == saved["params"], out


def test_repeated_layers_collapse_on_2000_params(ckpts, capsys):
    path, saved = ckpts["big"]
    assert len(saved["params"]) == 2000
    code, out, _ = _run(capsys, path)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) < 15, out
    assert "2000 params, 2000 with state, 1 group(s)" in out, out
    assert "    {0..999}.weight  exp_avg float32 4x4, exp_avg_sq float32 4x4; step=1  (x1000)" in (
        lines
    ), out
    assert "    {0..999}.bias    exp_avg float32 4, exp_avg_sq float32 4; step=1  (x1000)" in (
        lines
    ), out
    assert "    {0..999}.weight  float32 4x4  (x1000)" in lines, out  # the model's entries
    # JSON holds every param unless asked otherwise
    code, out, _ = _run(capsys, path, "--json")
    params = json.loads(out)["optimizers"]["optimizer"]["groups"][0]["params"]
    assert list(params) == saved["params"]


def test_filter_and_limit(ckpts, capsys):
    path, saved = ckpts["big"]
    pattern = "99*.weight"
    expected = [n for n in saved["params"] if fnmatch.fnmatchcase(n, pattern)]
    assert len(expected) == 11  # 99 and 990..999
    code, out, _ = _run(capsys, path, "--filter", pattern, "--expand", "--json")
    params = json.loads(out)["optimizers"]["optimizer"]["groups"][0]["params"]
    assert code == 0 and list(params) == expected
    assert list(json.loads(out)["other"]["model"]["entries"]) == expected
    code, out, _ = _run(capsys, path, "--filter", pattern, "--expand")
    assert f"    11 of 2000 match {pattern!r}" in out, out
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("    99")]
    assert listed == expected + expected, out  # optimizer params, then the model's entries
    code, out, _ = _run(capsys, path, "--expand", "--limit", "5")
    param_lines = [ln for ln in out.splitlines() if ln.startswith("    ") and "exp_avg" in ln]
    assert [ln.split()[0] for ln in param_lines] == saved["params"][:5]
    assert "    ... 1995 more params (--limit 0 shows all, --filter GLOB selects)" in out, out
    code, out, _ = _run(capsys, path, "--json", "--limit", "5")
    params = json.loads(out)["optimizers"]["optimizer"]["groups"][0]["params"]
    assert list(params) == saved["params"][:5]
    code, out, err = _run(capsys, path, "--limit", "-1", "--json")
    assert code == 2 and json.loads(out)["status"] == "bad_input" and "--limit" in err


def test_closed_pipe_ends_quietly(ckpts):
    path, _ = ckpts["big"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "mfsdp_optim.checkpoint", "inspect", path, "--expand", "--limit"]
    proc = subprocess.Popen(
        [*cmd, "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout is not None
    # the reader goes away before the first line (as `| head -1` does once it has its line;
    # closing first makes the broken pipe certain rather than a race with the pipe's buffer)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 0, err


def test_verify_says_when_there_is_nothing_to_verify(ckpts, capsys):
    plain, _ = ckpts["plain"]
    code, out, err = _run(capsys, plain, "--verify")
    assert code == 4, err
    assert "--verify: nothing to verify" in err and "no checksums" in err, err
    assert "[optimizer] layout fsdp_dtensor (format 3): 24 params" in out, out
    code, out, _ = _run(capsys, plain, "--verify", "--json")
    report = json.loads(out)
    assert code == 4 and report["exit_code"] == 4 and report["verify"] == "nothing to verify"
    assert report["status"] == "dcp" and not report["checksums_verified"]
    # without --verify the plain checkpoint is fine; with the marker's checksums it verifies
    assert _run(capsys, plain)[0] == 0
    small, _ = ckpts["small"]
    code, out, err = _run(capsys, small, "--verify", "--json")
    report = json.loads(out)
    assert code == 0 and report["verify"] == "verified" and report["checksums_verified"], err


def test_json_status_value_and_errors_on_stdout(ckpts, capsys):
    small, _ = ckpts["small"]
    report = json.loads(_run(capsys, small, "--json")[1])
    assert report["status"] == "complete" and "save_checkpoint" in report["detail"]
    # a damaged copy: a truncated shard -> exit 3 and a JSON error document on stdout
    damaged = str(ckpts["root"] / "damaged")
    shutil.copytree(small, damaged)
    shard = sorted(n for n in os.listdir(damaged) if n.endswith(".distcp"))[0]
    with open(os.path.join(damaged, shard), "r+b") as f:
        f.truncate(10)
    code, out, err = _run(capsys, damaged, "--json")
    doc = json.loads(out)
    assert code == 3 and doc["exit_code"] == 3 and doc["status"] == "damaged"
    assert doc["error"]["type"] == "CorruptCheckpointError" and shard in doc["error"]["message"]
    assert shard in err  # and the message on stderr, as without --json
    code, out, _ = _run(capsys, str(ckpts["root"] / "nowhere"), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["status"] == "bad_input"
    assert (
        doc["error"]["type"] == "FileNotFoundError"
        and "no such checkpoint" in (doc["error"]["message"])
    )


def test_help_has_examples(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "examples:" in out and "inspect ckpt/step_100 --filter" in out, out
    assert "exit status:" in out and "4  --verify, but the checkpoint has no checksums" in out
