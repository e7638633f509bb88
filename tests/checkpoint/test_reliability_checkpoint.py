"""All-or-nothing checkpoints on real gloo ranks: agreed directories, reserved names, loads that
refuse before (or without) touching live state, and overwrites that survive a SIGKILL anywhere.

Every load refusal is checked bit for bit: the live params and optimizer state (and group
hyperparameters) of every rank are snapshotted before and compared after. Every collective case
asserts how long the ranks took to raise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from _checkpoint_helpers import Model, same, snapshot

from mfsdp_optim.checkpoint import (
    build_sharded_state_dict,
    checkpoint_status,
    load_checkpoint,
    save_checkpoint,
)

FAST_S = 5.0


def _trained(opt="adamw_amsgrad", steps=2, lr_scale=1.0):
    m = Model("fsdp", opt, lr_scale=lr_scale)
    for t in range(steps):
        m.step(t)
    return m


def _snap(m):
    return snapshot(m), [p._local_tensor.clone() for p in m.params]


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


# ------------------------------------------------------------------------------------------
# save: one agreed directory, reserved names


def _rank_save_names(root):
    rank = dist.get_rank()
    m = _trained(steps=1)
    sd = {"optimizer": build_sharded_state_dict(m.optimizer, m.records)}
    out = {}
    # each rank its own name (e.g. a per-rank timestamp in the path)
    out["per_rank"] = _timed(lambda: save_checkpoint(sd, os.path.join(root, f"step_r{rank}")))
    # one rank differs
    out["one_differs"] = _timed(
        lambda: save_checkpoint(sd, os.path.join(root, "odd" if rank == 3 else "even"))
    )
    out["staging_name"] = _timed(lambda: save_checkpoint(sd, os.path.join(root, "a.incomplete")))
    out["old_name"] = _timed(lambda: save_checkpoint(sd, os.path.join(root, "a.old-0123abcd")))
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    dist.barrier()  # every rank has looked before rank 0 stages the control save
    # the control: the same name everywhere saves and loads
    save_checkpoint(sd, os.path.join(root, "good"))
    out["control"] = checkpoint_status(os.path.join(root, "good"))[0]
    dist.barrier()
    return out


def test_save_needs_one_directory_on_every_rank_and_refuses_reserved_names(ranks, tmp_path):
    out = ranks(4).run(_rank_save_names, str(tmp_path), timeout=120)
    for rank, res in enumerate(out):
        for case in ("per_rank", "one_differs"):
            name, msg, elapsed = res[case]
            assert name == "RankDisagreementError", (rank, case, res[case])
            assert "ranks disagree on the checkpoint directory" in msg and "nothing written" in msg
            assert elapsed < FAST_S, (rank, case, elapsed)
        assert "'/" in res["per_rank"][1] and "on ranks [3]" in res["one_differs"][1]
        for case in ("staging_name", "old_name"):
            name, msg, elapsed = res[case]
            assert name == "ValueError" and "are reserved" in msg and "Choose another" in msg
            assert elapsed < FAST_S
        assert res["left"] == [], f"rank {rank}: a refused save left {res['left']}"
        assert res["control"] == "complete"


# ------------------------------------------------------------------------------------------
# load: keys both ways, bit for bit unchanged


def _rank_load_refusals(root):
    rank = dist.get_rank()
    amsgrad = os.path.join(root, "amsgrad")
    src = _trained("adamw_amsgrad")
    save_checkpoint({"optimizer": build_sharded_state_dict(src.optimizer, src.records)}, amsgrad)
    out = {}
    live = _trained("adamw", steps=1, lr_scale=2.0)  # amsgrad=False

    def load(path, strict=True, **kw):
        target = {
            "optimizer": build_sharded_state_dict(live.optimizer, live.records, is_loading=True)
        }
        load_checkpoint(target, path, strict=strict, **kw)
        return target

    before = _snap(live)
    out["amsgrad_into_plain"] = _timed(lambda: load(amsgrad))
    out["amsgrad_into_plain/untouched"] = same(_snap(live), before)
    out["per_rank_dir"] = _timed(lambda: load(os.path.join(root, f"amsgrad_r{rank}")))
    out["per_rank_dir/untouched"] = same(_snap(live), before)
    target = load(amsgrad, strict=False)  # the opt-out: the extra key is left out
    out["non_strict_keys"] = sorted(target["optimizer"]["state"]["layers.0.weight"])
    dist.barrier()
    return out


def test_load_refuses_checkpoint_keys_the_target_lacks(ranks, tmp_path):
    out = ranks(4).run(_rank_load_refusals, str(tmp_path), timeout=120)
    for rank, res in enumerate(out):
        name, msg, elapsed = res["amsgrad_into_plain"]
        assert name == "StateDictMismatchError", (rank, res["amsgrad_into_plain"])
        assert "max_exp_avg_sq" in msg and "amsgrad=True" in msg and "strict=False" in msg, msg
        assert "nothing was loaded" in msg and elapsed < FAST_S
        assert res["amsgrad_into_plain/untouched"], f"rank {rank}: the refused load changed state"
        name, msg, elapsed = res["per_rank_dir"]
        assert name == "RankDisagreementError" and "checkpoint directory" in msg, msg
        assert res["per_rank_dir/untouched"] and elapsed < FAST_S
        # format 2: step travels in the param's param_to_group_meta leaf, not under "state"
        assert res["non_strict_keys"] == ["exp_avg", "exp_avg_sq"]


def _flip(path, file, offset):
    f = os.path.join(path, file)
    with open(f, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


def _items(path):
    with open(os.path.join(path, "mfsdp_checksums.json")) as f:
        return json.load(f)["items"]


def _rank_damaged_items(root):
    rank = dist.get_rank()
    good = os.path.join(root, "good")
    src = _trained("adamw_amsgrad")
    save_checkpoint({"optimizer": build_sharded_state_dict(src.optimizer, src.records)}, good)
    live = _trained("adamw_amsgrad", steps=1, lr_scale=2.0)
    out = {}
    for case in ("non_tensor_crc", "no_verify_tensor", "no_verify_tensor_in_place"):
        path = os.path.join(root, case)
        if rank == 0:
            shutil.copytree(good, path)
            items = _items(path)
            if case == "non_tensor_crc":  # the format-3 table (every hyperparameter and step)
                it = next(i for i in items if i["key"].endswith(".param_to_group_meta"))
                _flip(path, it["file"], it["start"] + it["length"] // 2)
            else:  # the pickle of rank 3's exp_avg chunk: DCP has copied others when it fails
                it = max(
                    (i for i in items if i["key"].endswith("layers.0.weight.exp_avg")),
                    key=lambda i: (i["file"], i["start"]),
                )
                _flip(path, it["file"], it["start"] + 1)
        dist.barrier()
        target = {
            "optimizer": build_sharded_state_dict(live.optimizer, live.records, is_loading=True)
        }
        before = _snap(live)
        kw = {} if case == "non_tensor_crc" else {"verify_checksums": False}
        out[case] = _timed(
            lambda target=target, path=path, case=case, kw=kw: load_checkpoint(
                target, path, in_place=case.endswith("in_place"), **kw
            )
        )
        out[case + "/untouched"] = same(_snap(live), before)
        dist.barrier()
    return out


def test_damaged_items_are_refused_with_state_bit_for_bit_unchanged(ranks, tmp_path):
    out = ranks(4).run(_rank_damaged_items, str(tmp_path), timeout=180)
    for rank, res in enumerate(out):
        name, msg, elapsed = res["non_tensor_crc"]
        assert name == "CorruptCheckpointError" and "checksum mismatch" in msg, msg
        assert "param_to_group_meta" in msg and "nothing was loaded" in msg
        assert res["non_tensor_crc/untouched"] and elapsed < FAST_S
        # verification off: DCP itself fails on the damaged item, after copying others
        name, msg, elapsed = res["no_verify_tensor"]
        assert "nothing was loaded" in msg and "dcp.load failed" in msg, (name, msg)
        assert res["no_verify_tensor/untouched"], f"rank {rank}: a failed load changed state"
        assert elapsed < FAST_S + 5
        # the control: in_place=True (no staging copies) does change the live state
        assert "partly loaded" in res["no_verify_tensor_in_place"][1]
    assert not all(res["no_verify_tensor_in_place/untouched"] for res in out), (
        "the control did not change the state: the staging test above proves nothing"
    )


# ------------------------------------------------------------------------------------------
# overwrite=True: SIGKILL at each point of the publish, the name always loads whole


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from mfsdp_optim.checkpoint import save_checkpoint
    from mfsdp_optim.checkpoint._on_disk import _publish

    path, point = sys.argv[1], sys.argv[2]
    sd = lambda v: {"optimizer": {"state": {"w": {"exp_avg": torch.full((64,), v)}},
                                  "param_to_group_meta": {"w": {"lr": v}}}}
    save_checkpoint(sd(1.0), path)
    real_exchange, real_rename, real_rmtree = _publish._exchange, os.rename, _publish.shutil.rmtree

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def exchange(a, b):
        if point == "before_exchange":
            die()
        if point.startswith("fallback"):
            def rename(src, dst):
                real_rename(src, dst)
                if point == "fallback_between_renames" and ".old-" in dst:
                    die()  # the old one moved away, the new one not yet in place
            os.rename = rename
            return False
        ok = real_exchange(a, b)
        assert ok, "renameat2 RENAME_EXCHANGE unavailable"
        if point == "after_exchange":
            die()
        return ok

    def rmtree(p, *a, **k):
        if point == "during_cleanup":
            real_rmtree(os.path.join(p, ".metadata"), ignore_errors=True)
            die()
        return real_rmtree(p, *a, **k)

    _publish._exchange = exchange
    _publish.shutil.rmtree = rmtree
    save_checkpoint(sd(2.0), path, overwrite=True)
    print("finished")
""")

POINTS = {  # kill point: the value the name must load afterwards
    "before_exchange": 1.0,
    "after_exchange": 2.0,
    "during_cleanup": 2.0,
    "fallback_between_renames": 1.0,
    "none": 2.0,
}


@pytest.mark.parametrize("point", sorted(POINTS))
def test_overwrite_killed_anywhere_leaves_a_whole_checkpoint(tmp_path, point):
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, "-c", _KILL_SCRIPT, path, point],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if point == "none":
        assert r.returncode == 0 and "finished" in r.stdout, r.stderr
    else:
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    status, msg = checkpoint_status(path)
    assert status == "complete", msg
    target = {
        "optimizer": {
            "state": {"w": {"exp_avg": torch.zeros(64)}},
            "param_to_group_meta": {"w": {"lr": 0.0}},
        }
    }
    load_checkpoint(target, path)
    want = POINTS[point]
    assert torch.equal(target["optimizer"]["state"]["w"]["exp_avg"], torch.full((64,), want))
    assert target["optimizer"]["param_to_group_meta"]["w"]["lr"] == want
    # the next save over the name works and cleans what the crash left
    save_checkpoint(
        {
            "optimizer": {
                "state": {"w": {"exp_avg": torch.full((64,), 3.0)}},
                "param_to_group_meta": {"w": {"lr": 3.0}},
            }
        },
        path,
        overwrite=True,
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)
