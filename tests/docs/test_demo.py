"""The README's first command, shortened: ``examples/demo.py --quick`` in a subprocess.

It spawns 4 gloo ranks (train, checkpoint at step 20), then 2 (resume from that checkpoint), and
prints a comparison of the two runs; this test checks that output, the checkpoint on disk, the
metrics and the plot. The same with ``--loss-scale dynamic``, and with ``--muon`` (Muon on the
hidden matrices and AdamW on the rest, in one wrapper).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "demo.py")


def _run_demo(out_dir, *extra: str, timeout: float = 240.0) -> str:
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints its Python stacks into stderr below.
    # A rank that died of a heap corruption: docs/troubleshooting.md, "A CPU rank dies" (the
    # demo's cause is gone; test_demo_model.py guards it)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, DEMO, "--quick", "--no-progress", "--out", str(out_dir), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, (
        f"demo failed ({proc.returncode}):\n{out[-4000:]}\n{proc.stderr[-6000:]}"
    )
    return out


def _comparison(out: str) -> tuple[float, float]:
    m = re.search(r"max \|loss diff\| = (\S+) \(tolerance (\S+)\): (MATCH|MISMATCH)", out)
    assert m, f"no resume comparison in the output:\n{out[-3000:]}"
    assert m.group(3) == "MATCH", m.group(0)
    return float(m.group(1)), float(m.group(2))


def _checkpoint_keys(path: str, *, world_saved: int) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    assert os.path.isfile(os.path.join(path, ".metadata")), os.listdir(path)
    shards = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert len(shards) == world_saved, shards  # one file per saving rank
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _check_checkpoint(path: str, *, world_saved: int) -> None:
    from mfsdp_optim.checkpoint import checkpoint_status

    # written by save_checkpoint, as the guide recommends (plain dcp.save gives "dcp")
    assert checkpoint_status(path)[0] == "complete", checkpoint_status(path)
    keys = _checkpoint_keys(path, world_saved=world_saved)
    # the model (get_model_state_dict) and the optimizer (fsdp_dtensor layout), for dense params
    # and for the experts of BOTH expert-parallel groups, plus the step counter
    for want in (
        "model.tok.weight",
        "model.layers.1.ffn.experts.0.fc1.weight",
        "model.layers.1.ffn.experts.3.fc2.bias",
        "optimizer.state.tok.weight.exp_avg",
        "optimizer.state.layers.1.ffn.experts.0.fc1.weight.exp_avg_sq",
        "optimizer.state.layers.1.ffn.experts.3.fc2.bias.exp_avg",
        "extra.step",
    ):
        assert want in keys, (want, sorted(keys)[:20])
    assert "optimizer.param_to_group_meta" in keys  # format 3: one item for every param


def _check_png(path: str, out: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
        pytest.skip("matplotlib is not installed: the demo ran, the PNG was not checked")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000, len(data)


def test_demo_quick(tmp_path):
    out = _run_demo(tmp_path)

    # stage 1: the global norm matches the brute-force reference; torch's clipping refuses
    ours = float(re.search(r"mfsdp_optim\.get_grad_norm\s+(\S+)", out).group(1))
    brute = float(re.search(r"brute force over every full_tensor\(\)\s+(\S+)", out).group(1))
    assert math.isclose(ours, brute, rel_tol=1e-5), (ours, brute)
    assert "identical on all 4 ranks: yes" in out
    assert re.search(r"torch\.nn\.utils\.clip_grad_norm_\s+refuses: ", out), out[:2000]

    # stages 2-4: it learns, and the resumed run on 2 ranks continues the 4-rank run
    diff, tol = _comparison(out)
    assert diff <= tol <= 1e-4
    with open(tmp_path / "metrics_train.json") as f:
        a = json.load(f)
    with open(tmp_path / "metrics_resume.json") as f:
        b = json.load(f)
    assert (a["world_size"], b["world_size"]) == (4, 2)
    assert a["step"] == list(range(40)) and b["step"] == list(range(20, 40))
    assert a["loss"][-1] < 0.3 * a["loss"][0], (a["loss"][0], a["loss"][-1])
    assert all(isinstance(z, int) for z in a["zeros"])
    # clipping is active at the start (the norm is reported before clipping)
    assert a["grad_norm"][0] > 1.0
    _check_checkpoint(str(tmp_path / "ckpt_step20"), world_saved=4)

    # stage 5: the plot
    _check_png(str(tmp_path / "demo.png"), out)


def test_demo_dynamic_loss_scale(tmp_path):
    """fp16 compute with DynamicGradScaler: the first steps overflow and are skipped on every
    rank, the scale backs off, training proceeds, and the scaler state survives the resume."""
    out = _run_demo(tmp_path, "--loss-scale", "dynamic", "--steps", "10", "--save-at", "5")
    diff, tol = _comparison(out)
    assert diff <= tol
    with open(tmp_path / "metrics_train.json") as f:
        a = json.load(f)
    with open(tmp_path / "metrics_resume.json") as f:
        b = json.load(f)
    assert a["precision"] == "fp16"
    assert a["skipped"][0] and not a["skipped"][-1], a["skipped"]
    assert a["loss_scale"][-1] < a["loss_scale"][0]
    # the resumed run starts with the scale the uninterrupted run had at that step
    assert b["loss_scale"][0] == a["loss_scale"][5]
    assert "SKIPPED" in out


def _metrics(out_dir) -> tuple[dict, dict]:
    with open(out_dir / "metrics_train.json") as f:
        a = json.load(f)
    with open(out_dir / "metrics_resume.json") as f:
        b = json.load(f)
    return a, b


def _early_diff(out: str) -> tuple[float, float]:
    m = re.search(r"first \d+ resumed steps: \|loss diff\| <= (\S+) \(tolerance (\S+):", out)
    assert m, f"no first-steps comparison in the output:\n{out[-3000:]}"
    return float(m.group(1)), float(m.group(2))


def test_demo_muon(tmp_path):
    """--muon: one wrapper over torch.optim.Muon (the blocks' 2-D matrices, experts on their
    expert meshes included) and AdamW (the rest), clipped by one global norm, checkpointed on 4
    ranks and resumed on 2. Muon stepped on local slices would orthogonalise different slices on
    4 and 2 ranks, and the resumed loss would leave the uninterrupted one at once."""
    out = _run_demo(tmp_path, "--muon")

    # which params each base optimizer steps: per rank, 6 dense block matrices + 2 local experts
    # x (fc1, fc2) on Muon; embeddings, head, norms, biases and the router on AdamW
    assert "torch.optim.Muon (10 hidden matrices, 4 of them this rank's experts" in out, out[:3000]
    ours = float(re.search(r"mfsdp_optim\.get_grad_norm\s+(\S+)", out).group(1))
    brute = float(re.search(r"brute force over every full_tensor\(\)\s+(\S+)", out).group(1))
    assert math.isclose(ours, brute, rel_tol=1e-5), (ours, brute)

    # the resume continues the loss: the first resumed steps (restored params and Muon/AdamW
    # state) to the fp32 tolerance, the rest within the bfloat16 Newton-Schulz drift
    early, early_tol = _early_diff(out)
    assert early <= early_tol <= 1e-4, (early, early_tol)
    diff, tol = _comparison(out)
    assert diff <= tol <= 1e-2
    a, b = _metrics(tmp_path)
    assert a["optimizers"] == b["optimizers"] == ["Muon", "AdamW"]
    assert (a["world_size"], b["world_size"]) == (4, 2)
    assert a["step"] == list(range(40)) and b["step"] == list(range(20, 40))
    ref = dict(zip(a["step"], a["loss"], strict=True))
    assert abs(b["loss"][0] - ref[20]) <= 1e-5  # the restored model, before any resumed step
    worst = max(abs(lb - ref[s]) for s, lb in zip(b["step"], b["loss"], strict=True))
    assert worst == pytest.approx(diff, rel=1e-2)  # the printed verdict is about these metrics
    assert a["loss"][-1] < 0.3 * a["loss"][0], (a["loss"][0], a["loss"][-1])
    assert a["grad_norm"][0] > 1.0  # clipping is active at the start
    assert not any(a["skipped"]) and not any(b["skipped"])

    # the checkpoint holds Muon's momentum for dense and expert matrices (both expert groups)
    # and AdamW's moments for the rest, in one optimizer state dict
    keys = _checkpoint_keys(str(tmp_path / "ckpt_step20"), world_saved=4)
    st = "optimizer.state."
    for want in (
        "layers.0.attn.qkv.weight.momentum_buffer",
        "layers.1.ffn.experts.0.fc1.weight.momentum_buffer",
        "layers.1.ffn.experts.3.fc2.weight.momentum_buffer",
        "tok.weight.exp_avg",
        "layers.1.ffn.router.weight.exp_avg_sq",
        "layers.1.ffn.experts.3.fc2.bias.exp_avg",
    ):
        assert st + want in keys, (want, sorted(keys)[:20])
    assert st + "layers.0.attn.qkv.weight.exp_avg" not in keys
    assert st + "tok.weight.momentum_buffer" not in keys
    # the output head, a 2-D matrix, is AdamW's (as docs/optimizers.md says), not Muon's
    assert st + "head.weight.exp_avg" in keys
    assert st + "head.weight.momentum_buffer" not in keys
    assert "optimizer.param_to_group_meta" in keys
    _check_png(str(tmp_path / "demo.png"), out)


def test_demo_muon_dynamic_loss_scale(tmp_path):
    """--muon with fp16 compute and DynamicGradScaler: the overflowing first steps are skipped
    by both base optimizers on every rank, and the resume continues with the scaler's state."""
    out = _run_demo(
        tmp_path, "--muon", "--loss-scale", "dynamic", "--steps", "10", "--save-at", "5"
    )
    diff, tol = _comparison(out)
    assert diff <= tol
    early, early_tol = _early_diff(out)
    assert early <= early_tol
    a, b = _metrics(tmp_path)
    assert a["optimizers"] == ["Muon", "AdamW"] and a["precision"] == "fp16"
    assert a["skipped"][0] and not a["skipped"][-1], a["skipped"]
    assert a["loss_scale"][-1] < a["loss_scale"][0]
    assert b["loss_scale"][0] == a["loss_scale"][5]
    assert a["loss"][-1] < a["loss"][0] - 0.5  # it trains once the steps go through
