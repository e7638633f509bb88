"""Reliability of checkpoints under real faults: ranks SIGKILLed mid-save (a separately spawned
process group with a short timeout), damaged files, rank disagreement, untrusted files.

Every fault is injected for real: a rank process kills itself with SIGKILL inside DCP's writer,
shard files are truncated / bit-flipped / deleted on disk, a ``.metadata`` is swapped for another
run's, and a crafted pickle is planted. Each test checks both that the fault is refused with a
clear message and that nothing else moved (the previous checkpoint, the live optimizer).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _checkpoint_helpers import (
    KILL_PG_TIMEOUT_S,
    Model,
    end_kill_rank,
    global_state,
    same,
    snapshot,
    spawn_ranks,
    start_kill_rank,
)

from mfsdp_optim.checkpoint import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankDisagreementError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    build_sharded_state_dict,
    checkpoint_status,
    load_checkpoint,
    load_sharded_state_dict,
    save_checkpoint,
)

# ------------------------------------------------------------------------------------------
# killed mid-save: a separate group of processes, one of which SIGKILLs itself


def _writer_cls(mode: str, victim: int):
    from torch.distributed.checkpoint import FileSystemWriter

    class KillingWriter(FileSystemWriter):
        """Kills this rank (SIGKILL, no cleanup) at a chosen point inside dcp.save."""

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            if mode == "after_shard" and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)  # its shard file is on disk, no metadata
            return fut

        def finish(self, metadata, results):
            super().finish(metadata, results)  # rank 0 only: .metadata is now on disk
            if mode == "after_metadata" and dist.get_rank() == victim:
                os.kill(os.getpid(), signal.SIGKILL)  # DCP finished, the publish did not

    return KillingWriter


def _kill_worker(rank, world, init_file, root, mode, victim):
    m, sd = start_kill_rank(rank, world, init_file, root)
    t0 = time.monotonic()
    outcome = {"rank": rank, "error": None}
    try:
        save_checkpoint(
            {"optimizer": sd}, os.path.join(root, "step_2"), writer_cls=_writer_cls(mode, victim)
        )
    except BaseException as exc:  # the survivors: record what they saw
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:600]
    outcome["elapsed_s"] = time.monotonic() - t0
    end_kill_rank(root, rank, outcome)


def _spawn_kill(root: str, mode: str, victim: int, world: int = 2) -> list:
    return spawn_ranks(_kill_worker, root, (mode, victim), world)[0]


def _load_into_fresh(path):
    m = Model("fsdp", "adam", lr_scale=5.0)
    target = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    load_checkpoint({"optimizer": target}, path)
    load_sharded_state_dict(m.optimizer, m.records, target)
    return global_state(build_sharded_state_dict(m.optimizer, m.records))


def _refuse_incomplete(path):
    m = Model("fsdp", "adam")
    target = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    before = snapshot(m)
    try:
        load_checkpoint({"optimizer": target}, path)
    except IncompleteCheckpointError as exc:
        assert same(snapshot(m), before), "a refused load changed the optimizer"
        return str(exc)
    return None


def _inspect_cli(path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "mfsdp_optim.checkpoint", "inspect", path],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("mode,victim", [("after_shard", 1), ("after_metadata", 0)])
def test_rank_killed_mid_save_keeps_previous_checkpoint(ranks, tmp_path, mode, victim):
    root = str(tmp_path)
    t0 = time.monotonic()
    codes = _spawn_kill(root, mode, victim)
    print(f"spawned group: {time.monotonic() - t0:.1f}s")
    assert codes[victim] == -signal.SIGKILL, codes
    survivors = [r for r in range(len(codes)) if r != victim]
    for r in survivors:
        assert codes[r] == 0, codes
        with open(os.path.join(root, f"outcome{r}.json")) as f:
            outcome = json.load(f)
        assert outcome["error"] is not None, f"rank {r} believed the save succeeded"
        assert "Nothing was published" in outcome["error"] or "did not reach" in outcome["error"], (
            outcome
        )
        assert outcome["elapsed_s"] < KILL_PG_TIMEOUT_S + 20, outcome
        print(f"survivor rank {r}: {outcome['elapsed_s']:.2f}s: {outcome['error'][:200]}")
    step1, step2 = os.path.join(root, "step_1"), os.path.join(root, "step_2")
    # step 2 was never published; what it wrote is in the staging dir, without a marker
    assert not os.path.exists(step2)
    assert os.path.isdir(step2 + ".incomplete")
    assert not os.path.exists(os.path.join(step2 + ".incomplete", "mfsdp_complete.json"))
    from mfsdp_optim.checkpoint._cli import main

    for p in (step2, step2 + ".incomplete"):
        status, msg = checkpoint_status(p)
        assert status == "incomplete" and "INCOMPLETE" in msg and "never finished" in msg
        assert main(["inspect", p]) == 3
    r = _inspect_cli(step2)  # the real entry point once
    assert r.returncode == 3 and "INCOMPLETE checkpoint" in r.stderr, (r.returncode, r.stderr)
    assert "never finished" in r.stderr and step2 + ".incomplete" in r.stderr
    pool = ranks(4)
    for p in (step2, step2 + ".incomplete"):
        msgs = pool.run(_refuse_incomplete, p)
        assert all(
            m is not None and "INCOMPLETE" in m and "nothing was loaded" in m for m in msgs
        ), msgs
    # step 1 is intact: inspect says complete, and it loads bit for bit (resharded 2 -> 4 ranks)
    assert checkpoint_status(step1)[0] == "complete"
    assert main(["inspect", step1]) == 0
    want = torch.load(os.path.join(root, "state_1.pt"), weights_only=True)
    out = pool.run(_load_into_fresh, step1)
    assert all(same(o, want) for o in out), "step_1 did not load back"


# ------------------------------------------------------------------------------------------
# damaged files: a clear error, and the live optimizer untouched


def _trained(steps, lr_scale=1.0, opt="adamw_amsgrad"):
    m = Model("fsdp", opt, lr_scale=lr_scale)
    for t in range(steps):
        m.step(t)
    return m


def _damage(path: str, how: str, other: str) -> None:
    """Damage the checkpoint at ``path`` (rank 0 only; the others wait at a barrier)."""
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    victim = os.path.join(path, shards[-1])
    if how == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    elif how == "bitflip":
        with open(victim, "r+b") as f:
            data = bytearray(f.read())
            data[len(data) * 2 // 3] ^= 0x10
            f.seek(0)
            f.write(data)
    elif how == "missing":
        os.remove(victim)
    elif how == "foreign_metadata":
        shutil.copy(os.path.join(other, ".metadata"), os.path.join(path, ".metadata"))
    elif how == "garbage_marker":
        with open(os.path.join(path, "mfsdp_complete.json"), "w") as f:
            f.write("{not json")
    else:
        raise AssertionError(how)


DAMAGE = {
    # how: (error class, words the message must hold)
    "truncated": (CorruptCheckpointError, "truncated"),
    "bitflip": (CorruptCheckpointError, "checksum mismatch"),
    "missing": (CorruptCheckpointError, "missing file"),
    "foreign_metadata": (CorruptCheckpointError, "not the file this save wrote"),
    "garbage_marker": (CorruptCheckpointError, "unreadable completion marker"),
}


def _damaged(root):
    rank = dist.get_rank()
    good, other = os.path.join(root, "good"), os.path.join(root, "other")
    src = _trained(2)
    save_checkpoint({"optimizer": build_sharded_state_dict(src.optimizer, src.records)}, good)
    o = _trained(3, opt="adam")
    save_checkpoint({"optimizer": build_sharded_state_dict(o.optimizer, o.records)}, other)
    live = _trained(1, lr_scale=2.0)  # the live optimizer that must stay untouched
    out = {}
    for how in DAMAGE:
        path = os.path.join(root, how)
        if rank == 0:
            shutil.copytree(good, path)
            _damage(path, how, other)
        dist.barrier()
        target = build_sharded_state_dict(live.optimizer, live.records, is_loading=True)
        before = snapshot(live)
        try:
            load_checkpoint({"optimizer": target}, path)
        except Exception as exc:
            out[how] = (type(exc).__name__, str(exc))
        else:
            out[how] = None
        out[how + "/untouched"] = same(snapshot(live), before)
        if rank == 0:
            shutil.rmtree(path)
        dist.barrier()
    # the control: the undamaged checkpoint loads, and it changes the live optimizer
    target = build_sharded_state_dict(live.optimizer, live.records, is_loading=True)
    before = snapshot(live)
    load_checkpoint({"optimizer": target}, good)
    load_sharded_state_dict(live.optimizer, live.records, target)
    out["control_changed"] = not same(snapshot(live), before)
    return out


def test_damaged_files_refused_and_optimizer_untouched(ranks, tmp_path):
    out = ranks(4).run(_damaged, str(tmp_path))
    for rank, res in enumerate(out):
        assert res["control_changed"], "the control load did not apply"
        for how, (cls, words) in DAMAGE.items():
            assert res[how] is not None, f"rank {rank}: {how} was loaded"
            name, msg = res[how]
            assert name == cls.__name__ and words in msg, (rank, how, name, msg)
            assert "nothing was loaded" in msg
            assert res[how + "/untouched"], f"rank {rank}: {how} changed the live optimizer"


# ------------------------------------------------------------------------------------------
# rank disagreement: an error that says so, within the group's timeout, never a hang


def _disagree(root, case):
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    if case == "keyspace":  # rank 1 runs another optimizer: different state keys
        m = _trained(2, opt="sgd" if rank == 1 else "adam")
        t0 = time.monotonic()
        try:
            build_sharded_state_dict(m.optimizer, m.records)
        except ValueError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return None
    m = _trained(2)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    if case == "model" and rank == 2:  # rank 2's model has another shape for one param
        v = sd["state"]["layers.0.weight"]["exp_avg"]
        sd["state"]["layers.0.weight"]["exp_avg"] = DTensor.from_local(
            torch.zeros(v._local_tensor.shape[0], 9),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=(10, 9),
            stride=(9, 1),
        )
    if case == "extra_param" and rank == 3:  # rank 3's model has a param the others lack
        sd["state"]["extra.weight"] = dict(sd["state"]["layers.0.weight"])
    if case == "scalar" and rank == 1:  # rank 1 is one step ahead: DCP would keep one 'step'
        from mfsdp_optim.checkpoint._state_dict._table import GroupMetaTable

        leaves = dict(sd["param_to_group_meta"].leaves())  # the table is read-only: a new one
        hyper, scalars = leaves["layers.0.bias"]
        leaves["layers.0.bias"] = (
            hyper,
            tuple((k, v + 1 if k == "step" else v, dt) for k, v, dt in scalars),
        )
        sd["param_to_group_meta"] = GroupMetaTable.from_leaves(leaves)
    t0 = time.monotonic()
    try:
        save_checkpoint({"optimizer": sd}, os.path.join(root, case))
    except RankDisagreementError as exc:
        wrote = os.path.exists(os.path.join(root, case))
        return type(exc).__name__, str(exc), time.monotonic() - t0, wrote
    return None


DISAGREE = {
    "keyspace": ("KeyspaceError", "ranks hold different state keys"),
    "model": ("RankDisagreementError", "rank 2 has a DTensor [10, 9]"),
    "extra_param": ("RankDisagreementError", "ranks [0, 1, 2] do not have it"),
    "scalar": ("RankDisagreementError", "'optimizer.param_to_group_meta': rank 0 has a Group"),
}


@pytest.mark.parametrize("case", sorted(DISAGREE))
def test_rank_disagreement_raises_everywhere(ranks, tmp_path, case):
    out = ranks(4).run(_disagree, str(tmp_path), case, timeout=60)
    name, words = DISAGREE[case]
    for rank, res in enumerate(out):
        assert res is not None, f"rank {rank}: the disagreement went unnoticed"
        assert res[0] == name and words in res[1], (rank, res[:2])
        assert res[2] < 10, f"rank {rank} took {res[2]:.1f}s"
        if len(res) > 3:
            assert not res[3], "a checkpoint was published despite the disagreement"


def _absent_rank(root):
    """Rank 3 never calls save_checkpoint; a subgroup with a 3 s timeout carries the save."""
    sub = dist.new_group(ranks=[0, 1, 2, 3], timeout=timedelta(seconds=3), backend="gloo")
    m = _trained(1)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    result = None
    if dist.get_rank() != 3:
        t0 = time.monotonic()
        try:
            save_checkpoint({"optimizer": sd}, os.path.join(root, "absent"), process_group=sub)
        except RuntimeError as exc:
            result = (str(exc), time.monotonic() - t0)
    dist.barrier()  # on WORLD: the pool stays usable
    dist.destroy_process_group(sub)
    return result, os.path.exists(os.path.join(root, "absent"))


def test_absent_rank_times_out_with_clear_error(ranks, tmp_path):
    out = ranks(4).run(_absent_rank, str(tmp_path), timeout=90)
    for rank in range(3):
        res, published = out[rank]
        assert res is not None, f"rank {rank} did not fail"
        msg, elapsed = res
        assert "did not reach save_checkpoint" in msg and elapsed < 15, (msg, elapsed)
        assert not published


# ------------------------------------------------------------------------------------------
# untrusted checkpoints: this package's reads run none of their code


class _Payload:
    """Unpickling this writes a sentinel file: proof that code ran."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _plant_metadata(path: str, sentinel: str) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(sentinel), f)


def test_malicious_metadata_is_never_unpickled(tmp_path):
    from mfsdp_optim.checkpoint import check_checkpoint, inspect_checkpoint, safe_read_metadata
    from mfsdp_optim.checkpoint._cli import main

    sentinel = str(tmp_path / "pwned")
    path = str(tmp_path / "ckpt")
    save_checkpoint(
        {
            "optimizer": {
                "state": {"a": {"exp_avg": torch.ones(3)}},
                "param_to_group_meta": {"a": {"lr": 0.1}},
            }
        },
        path,
    )
    _plant_metadata(path, sentinel)
    # our marker knows the metadata changed: refused before any unpickling
    with pytest.raises(CorruptCheckpointError, match="not the file this save wrote"):
        check_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="not the file this save wrote"):
        load_checkpoint(
            {
                "optimizer": {
                    "state": {"a": {"exp_avg": torch.zeros(3)}},
                    "param_to_group_meta": {"a": {"lr": 0.0}},
                }
            },
            path,
        )
    # without the marker (a plain DCP directory), the allow-list refuses it
    os.remove(os.path.join(path, "mfsdp_complete.json"))
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle posix.system"):
        safe_read_metadata(path)
    with pytest.raises(UnsafeCheckpointError):
        inspect_checkpoint(path)
    assert main(["inspect", path]) == 2
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(
            {"optimizer": {"state": {"a": {"exp_avg": torch.zeros(3)}}}}, path, require_marker=False
        )
    assert not os.path.exists(sentinel), "a planted pickle ran code"
    # the control: torch's own reader does run it (why this matters)
    from torch.distributed.checkpoint import FileSystemReader

    with contextlib.suppress(Exception):
        FileSystemReader(path).read_metadata()
    assert os.path.exists(sentinel), "the control did not run the payload"


def test_malicious_non_tensor_item_is_refused(tmp_path):
    """A hyperparameter entry holding a pickled callable: DefaultLoadPlanner would run it
    (torch.load weights_only=False); SafeLoadPlanner and inspect refuse it."""
    import torch.distributed.checkpoint as dcp

    from mfsdp_optim.checkpoint import inspect_checkpoint

    sentinel = str(tmp_path / "pwned")
    path = str(tmp_path / "ckpt")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {
                "optimizer": {
                    "state": {"a": {"exp_avg": torch.ones(3)}},
                    "param_to_group_meta": {"a": {"lr": _Payload(sentinel)}},
                }
            },
            checkpoint_id=path,
            no_dist=True,
        )
    assert not os.path.exists(sentinel)  # saving does not run it
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle .*lr.*posix.system"):
        inspect_checkpoint(path)
    target = {
        "optimizer": {
            "state": {"a": {"exp_avg": torch.zeros(3)}},
            "param_to_group_meta": {"a": {"lr": 0.0}},
        }
    }
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle"):
        load_checkpoint(target, path, require_marker=False)
    assert not os.path.exists(sentinel), "a planted pickle ran code"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=path, no_dist=True)  # the control: torch's default
    assert os.path.exists(sentinel), "the control did not run the payload"


# ------------------------------------------------------------------------------------------
# save helper contract in one process


def test_save_refuses_existing_and_cleans_stale_staging(tmp_path):
    sd = {
        "optimizer": {
            "state": {"a": {"exp_avg": torch.ones(4)}},
            "param_to_group_meta": {"a": {"lr": 0.1}},
        }
    }
    path = str(tmp_path / "ck")
    os.makedirs(path + ".incomplete")  # what a crashed save left
    open(os.path.join(path + ".incomplete", "__0_0.distcp"), "w").close()
    save_checkpoint(sd, path)
    assert not os.path.exists(path + ".incomplete")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_checkpoint(sd, path)
    sd["optimizer"]["state"]["a"]["exp_avg"] = torch.full((4,), 2.0)
    save_checkpoint(sd, path, overwrite=True)
    target = {
        "optimizer": {
            "state": {"a": {"exp_avg": torch.zeros(4)}},
            "param_to_group_meta": {"a": {"lr": 0.0}},
        }
    }
    load_checkpoint(target, path)
    assert torch.equal(target["optimizer"]["state"]["a"]["exp_avg"], torch.full((4,), 2.0))
    assert [n for n in os.listdir(tmp_path) if n != "ck"] == []
    # a plain DCP checkpoint has no marker: refused unless asked
    import torch.distributed.checkpoint as dcp

    plain = str(tmp_path / "plain")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=plain, no_dist=True)
    with pytest.raises(IncompleteCheckpointError, match="require_marker=False"):
        load_checkpoint(target, plain)
    load_checkpoint(target, plain, require_marker=False)
    # a foreign checkpoint (another model's keys) and a wrong shape: refused before loading
    with pytest.raises(StateDictMismatchError, match="has no entries for 1 of the 2 keys"):
        load_checkpoint(
            {
                "model": {"w": torch.zeros(4)},
                "optimizer": {"state": {"a": {"exp_avg": torch.zeros(4)}}},
            },
            path,
        )
    with pytest.raises(
        StateDictMismatchError,
        match=r"holds \[4\] torch.float32, the target is "
        r"\[5\]",
    ):
        load_checkpoint({"optimizer": {"state": {"a": {"exp_avg": torch.zeros(5)}}}}, path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_checkpoint(target, str(tmp_path / "nothing"))
