"""The asynchronous save on real gloo ranks: what is written is the copy made before
``save_checkpoint`` returned (the live params and state are changed while DCP writes), a second
save waits for the first, errors reach every rank on ``wait()`` or on the next call.

The writes are held at a gate (a writer that waits for an event the test sets) so the changes
to the live tensors happen, for certain, while the save is in flight. Every collective case
asserts how long the ranks took to raise.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _checkpoint_helpers import (
    KILL_PG_TIMEOUT_S,
    Model,
    end_kill_rank,
    global_params,
    global_state,
    same,
    snapshot,
    spawn_ranks,
    start_kill_rank,
)
from torch.distributed.checkpoint import FileSystemWriter

from mfsdp_optim.checkpoint import (
    IncompleteCheckpointError,
    build_sharded_state_dict,
    checkpoint_status,
    load_checkpoint,
    load_sharded_state_dict,
    save_checkpoint,
)

FAST_S = 5.0
GATE = threading.Event()  # per rank process: the held writes go on once it is set


class GatedWriter(FileSystemWriter):
    """Holds DCP's writes until ``GATE`` is set (at most 30 s)."""

    def write_data(self, plan, planner):
        GATE.wait(30)
        return super().write_data(plan, planner)


class FailingWriter(FileSystemWriter):
    """Rank 1's writes fail (a full disk, say)."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)


def _trained(steps=2, lr_scale=1.0):
    m = Model("fsdp", "adamw", lr_scale=lr_scale)
    for t in range(steps):
        m.step(t)
    return m


def _state(m):
    return {
        "optimizer": build_sharded_state_dict(m.optimizer, m.records),
        "model": {r.fqn: r.param for r in m.records},
    }


def _load_fresh(path):
    m = Model("fsdp", "adamw", lr_scale=3.0)
    target = {
        "optimizer": build_sharded_state_dict(m.optimizer, m.records, is_loading=True),
        "model": {r.fqn: r.param for r in m.records},
    }
    load_checkpoint(target, path)
    load_sharded_state_dict(m.optimizer, m.records, target["optimizer"])
    return global_state(build_sharded_state_dict(m.optimizer, m.records)), global_params(m)


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def _rank_staged_copy(root):
    path = os.path.join(root, "ckpt")
    m = _trained()
    sd = _state(m)
    want = global_state(sd["optimizer"]), global_params(m)
    GATE.clear()
    handle = save_checkpoint(sd, path, asynchronous=True, writer_cls=GatedWriter)
    out = {"done_while_held": handle.done()}
    out["timeout"] = _timed(lambda: handle.wait(timeout=0.05))
    # training goes on while the writes are held: a step, then every tensor scribbled over
    m.step(5)
    with torch.no_grad():
        for r in m.records:
            r.param._local_tensor.add_(100.0)
            for v in m.optimizer.state.get(r.opt_param, {}).values():
                v.add_(7.0)
        for g in m.optimizer.param_groups:
            g["lr"] = 123.0
    GATE.set()
    out["wait"] = handle.wait(timeout=60)
    out["done"] = handle.done()
    out["status"] = checkpoint_status(path)[0]
    out["loaded_as_saved"] = same(_load_fresh(path), want)
    out["live_changed"] = not same((global_state(_state(m)["optimizer"]), global_params(m)), want)
    return out


def test_async_save_writes_the_copy_made_before_it_returned(ranks, tmp_path):
    out = ranks(2).run(_rank_staged_copy, str(tmp_path), timeout=120)
    for rank, res in enumerate(out):
        assert res["done_while_held"] is False, rank
        name, msg, _ = res["timeout"]
        assert name == "TimeoutError" and "still running" in msg, res["timeout"]
        assert res["wait"] == os.path.join(str(tmp_path), "ckpt") and res["done"]
        assert res["status"] == "complete"
        assert res["live_changed"], "the control: the live state did not change"
        assert res["loaded_as_saved"], f"rank {rank}: the checkpoint holds values changed after"


def _rank_second_waits(root):
    first, second = os.path.join(root, "first"), os.path.join(root, "second")
    m = _trained()
    GATE.clear()
    handle = save_checkpoint(_state(m), first, asynchronous=True, writer_cls=GatedWriter)
    threading.Timer(1.0, GATE.set).start()  # the writes go on a second from now
    t0 = time.monotonic()
    save_checkpoint(_state(m), second)  # waits for the first, then saves
    out = {"waited_s": time.monotonic() - t0, "first_done": handle.done()}
    out["statuses"] = [checkpoint_status(first)[0], checkpoint_status(second)[0]]
    out["first_wait"] = handle.wait(timeout=0)
    return out


def test_a_second_save_waits_for_the_one_in_flight(ranks, tmp_path):
    out = ranks(2).run(_rank_second_waits, str(tmp_path), timeout=120)
    for res in out:
        assert res["first_done"] and res["waited_s"] >= 0.9, res
        assert res["statuses"] == ["complete", "complete"]
        assert res["first_wait"].endswith("first")


def _rank_errors(root):
    good, bad = os.path.join(root, "good"), os.path.join(root, "bad")
    m = _trained()
    save_checkpoint(_state(m), good)
    out = {}
    # reported by wait(), on every rank; the next save is not refused for it
    handle = save_checkpoint(_state(m), bad, asynchronous=True, writer_cls=FailingWriter)
    out["wait"] = _timed(lambda: handle.wait(timeout=60))
    out["after_wait"] = _timed(lambda: save_checkpoint(_state(m), os.path.join(root, "next")))
    # never waited for: the next call raises it, on every rank, and saves nothing
    handle = save_checkpoint(_state(m), bad, asynchronous=True, writer_cls=FailingWriter)
    dist.barrier()
    out["next_call"] = _timed(lambda: save_checkpoint(_state(m), os.path.join(root, "refused")))
    out["then"] = _timed(lambda: save_checkpoint(_state(m), os.path.join(root, "then")))
    handle = save_checkpoint(_state(m), bad, asynchronous=True, writer_cls=FailingWriter)
    dist.barrier()
    out["next_load"] = _timed(lambda: _load_fresh(good))
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    return out


def test_errors_reach_every_rank_on_wait_or_on_the_next_call(ranks, tmp_path):
    out = ranks(2).run(_rank_errors, str(tmp_path), timeout=180)
    for rank, res in enumerate(out):
        name, msg, elapsed = res["wait"]
        assert name == "RuntimeError" and "Nothing was published" in msg, res["wait"]
        assert "No space left on device" in msg and elapsed < FAST_S, (rank, res["wait"])
        assert res["after_wait"] is None, res["after_wait"]
        for case in ("next_call", "next_load"):
            name, msg, elapsed = res[case]
            assert name == "RuntimeError", (rank, case, res[case])
            assert "previous asynchronous save" in msg and "never reported" in msg, msg
            assert "No space left on device" in msg and elapsed < FAST_S + 2, res[case]
        assert res["then"] is None, res["then"]
        # nothing of the refused saves is published; the failed one's files stay staged
        assert res["listing"] == ["bad.incomplete", "good", "next", "then"], res["listing"]


# ------------------------------------------------------------------------------------------
# An exception on one rank of the background's collectives, the rank kept alive: before the
# report gather (its report does not pickle), during it (it cannot unpickle what it received),
# after it (its own step after the gather, before the all-reduce that allows the publish)

BG_THREAD = "mfsdp-async-save"


class _FailingLoads:
    """The ``pickle`` module as ``comm`` uses it, whose first ``loads`` on rank 1's background
    thread fails: the gather's exchange is complete, this rank cannot read what it brought."""

    HIGHEST_PROTOCOL = __import__("pickle").HIGHEST_PROTOCOL
    dumps = staticmethod(__import__("pickle").dumps)
    failed = False

    @classmethod
    def loads(cls, data):
        import pickle

        bg = threading.current_thread().name == BG_THREAD
        if dist.get_rank() == 1 and bg and not cls.failed:
            cls.failed = True
            raise pickle.UnpicklingError("injected: the gathered payload is unreadable")
        return pickle.loads(data)


def _rank_background_fault(root, point):
    from mfsdp_optim._infra import comm
    from mfsdp_optim.checkpoint._on_disk import _save_checkpoint as _save

    good, new = os.path.join(root, "good"), os.path.join(root, f"new_{point}")
    m = _trained()
    sd = _state(m)
    want = global_state(sd["optimizer"]), global_params(m)
    save_checkpoint(sd, good)
    m.step(3)
    hit = lambda: dist.get_rank() == 1 and threading.current_thread().name == BG_THREAD  # noqa: E731
    real = (_save.item_record, comm.pickle, getattr(_save, "_read_reports", None))

    def item_record(*args):
        rec = real[0](*args)
        if hit():
            rec["hook"] = lambda: None  # does not pickle
        return rec

    def read_reports(raw, world):
        out = real[2](raw, world)
        if hit():
            raise ValueError("injected: rank 1 fails after the gather")
        return out

    real_signatures = _save.signatures

    def signatures(*args, **kwargs):
        if hit():
            raise ValueError("injected: rank 1 cannot describe what it saves")
        return real_signatures(*args, **kwargs)

    real_plain = _save.plain_writers

    def plain_writers(*args, **kwargs):
        if hit():
            raise ValueError("injected: rank 1 fails after the agreement, before writing")
        return real_plain(*args, **kwargs)

    if point == "agree":  # the agreement on what is saved, the first background collective
        _save.signatures = signatures
    elif point == "agreed":  # after it: this rank's own error rides in the report gather
        _save.plain_writers = plain_writers
    elif point == "before":
        _save.item_record = item_record
    elif point == "during":
        comm.pickle = _FailingLoads
    else:
        _save._read_reports = read_reports
    try:
        handle = save_checkpoint(_state(m), new, asynchronous=True)
        m.step(4)  # training goes on meanwhile
        out = {"wait": _timed(lambda: handle.wait(timeout=60))}
    finally:
        _save.item_record, comm.pickle = real[:2]
        _save.signatures, _save.plain_writers = real_signatures, real_plain
        if point == "after":
            _save._read_reports = real[2]
    # the background group is still in step on every rank: the next save goes through
    out["next"] = _timed(
        lambda: save_checkpoint(_state(m), new + "_next", asynchronous=True).wait(timeout=60)
    )
    dist.barrier()
    out["previous"] = same(_load_fresh(good), want)
    out["new"] = _timed(lambda: _load_fresh(new))
    out["listing"] = sorted(n for n in os.listdir(root) if n.startswith(f"new_{point}"))
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("point", ["agree", "agreed", "before", "during", "after"])
def test_background_fault_on_one_live_rank_reaches_every_rank(ranks, tmp_path, point):
    out = ranks(2).run(_rank_background_fault, str(tmp_path), point, timeout=140)
    # one error on every rank: the failing rank's class where the protocol keeps it, else
    # RuntimeError
    assert len({res["wait"][0] for res in out}) == 1, [res["wait"] for res in out]
    for rank, res in enumerate(out):
        name, msg, elapsed = res["wait"]
        assert name in ("RuntimeError", "ValueError") and elapsed < FAST_S, (rank, res["wait"])
        assert "rank 1" in msg, (rank, msg)
        assert res["next"] is None, (rank, res["next"])
        assert res["previous"], f"rank {rank}: the previous checkpoint changed"
        assert res["new"][0] in ("IncompleteCheckpointError", "FileNotFoundError"), res["new"]
        if point == "agree":  # refused before any write: nothing left behind
            assert "cannot describe what it saves" in msg, (rank, msg)
            assert res["listing"] == [f"new_{point}_next"], res["listing"]
        else:
            assert "Nothing was published" in msg, (rank, msg)
            assert res["listing"] == [f"new_{point}.incomplete", f"new_{point}_next"], res[
                "listing"
            ]


def _rank_disagree(root):
    from mfsdp_optim.checkpoint import RankDisagreementError

    m = _trained()
    bad = os.path.join(root, "bad")
    sd = dict(_state(m), extra={"tag": "same" if dist.get_rank() == 0 else "other"})
    t0 = time.perf_counter()
    handle = save_checkpoint(sd, bad, asynchronous=True)
    returned = time.perf_counter() - t0
    try:
        handle.wait(timeout=60)
        out: dict = {"wait": None}
    except RankDisagreementError as exc:
        out = {"wait": str(exc)}
    out["returned_s"] = returned
    save_checkpoint(_state(m), os.path.join(root, "next"), asynchronous=True).wait(timeout=60)
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    return out


@pytest.mark.timeout(120)
def test_async_disagreement_is_raised_by_wait_on_every_rank(ranks, tmp_path):
    """What the ranks save is agreed in the background, on the copy: a plain value that differs
    between ranks is refused by every rank's ``wait()``, nothing is left on disk, and the
    background group stays in step for the next save."""
    out = ranks(2).run(_rank_disagree, str(tmp_path), timeout=110)
    for rank, res in enumerate(out):
        assert res["wait"] is not None and "'extra.tag'" in res["wait"], (rank, res)
        assert "nothing written" in res["wait"], (rank, res["wait"])
        assert res["listing"] == ["next"], (rank, res["listing"])


# ------------------------------------------------------------------------------------------
# SIGKILL at each stage of an asynchronous save: a separately spawned group of processes

# stage: (the rank killed when one rank is, whether the new checkpoint is then published)
STAGES = {
    "staging": (1, False),  # inside the copy off the live tensors (foreground)
    "writing": (1, False),  # inside DCP's write (background thread)
    "before_marker": (0, False),  # rank 0, about to write the completion marker
    "after_marker": (0, False),  # rank 0, the marker written, not yet renamed into place
    "published": (0, True),  # rank 0, right after the publishing rename
    "published_sync": (0, True),  # the same, of a synchronous save
}
# the default suite runs these three; MFSDP_CHECKPOINT_KILLS=all runs every stage both ways
DEFAULT_KILLS = {
    ("writing", "one"),
    ("after_marker", "all"),
    ("published", "one"),
    ("published_sync", "one"),
}
_FULL = pytest.mark.skipif(
    os.environ.get("MFSDP_CHECKPOINT_KILLS") != "all",
    reason="one of the full kill matrix: MFSDP_CHECKPOINT_KILLS=all",
)
KILLS = [
    pytest.param(stage, who, marks=[] if (stage, who) in DEFAULT_KILLS else [_FULL])
    for stage in STAGES
    for who in ("one", "all")
    if (stage, who) != ("published_sync", "all")
]


def _kill_worker(rank, world, init_file, root, stage, who):
    from mfsdp_optim.checkpoint._on_disk import _async, _publish

    m, sd = start_kill_rank(rank, world, init_file, root)
    state = global_state(sd)
    if rank == 0:
        torch.save(state, os.path.join(root, "state_2.pt"))
    dist.barrier()
    final = os.path.join(root, "step_2")
    victim = who == "all" or rank == STAGES[stage][0]

    def die():
        if who == "all":  # the first to die asks the parent to kill every rank
            open(os.path.join(root, "kill_all"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    real_stage, real_json, real_fsync = _async.stage, _publish.write_json, _publish._fsync_dir

    def staging(sd):
        if stage == "staging" and victim:
            die()
        return real_stage(sd)

    def write_json(path, obj, **kw):
        marker = path.endswith("mfsdp_complete.json")
        if stage == "before_marker" and marker and victim:
            die()
        real_json(path, obj, **kw)
        if stage == "after_marker" and marker and victim:
            die()

    def fsync_dir(path):
        real_fsync(path)
        if stage.startswith("published") and path == root and victim:  # the rename is done
            die()

    class KillingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            if stage == "writing" and victim:
                die()  # this rank's shard file is on disk, the others' maybe not
            return fut

    _async.stage, _publish.write_json, _publish._fsync_dir = staging, write_json, fsync_dir
    t0 = time.monotonic()
    outcome = {"rank": rank, "error": None}
    try:
        if stage.endswith("_sync"):
            save_checkpoint({"optimizer": sd}, final, writer_cls=KillingWriter)
        else:
            handle = save_checkpoint(
                {"optimizer": sd}, final, asynchronous=True, writer_cls=KillingWriter
            )
            m.step(2)  # training goes on during the write
            handle.wait(timeout=120)
    except BaseException as exc:  # the survivors: record what they saw
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    if who == "all":
        # the whole job dies at this stage: a rank with no kill point of its own (only rank 0
        # writes the marker) waits here for the SIGKILL the victim's kill_all brings, instead
        # of racing it to a clean exit (a fast machine finished first); 3: never killed
        time.sleep(KILL_PG_TIMEOUT_S + 60)
        os._exit(3)
    outcome["elapsed_s"] = time.monotonic() - t0
    end_kill_rank(root, rank, outcome)


def _spawn_kill(root, stage, who, world=2):
    codes, hung = spawn_ranks(_kill_worker, root, (stage, who), world)
    assert not hung, f"ranks {hung} hung"
    return codes


def _load_state(path):
    m = Model("fsdp", "adam", lr_scale=5.0)
    target = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    before = snapshot(m)
    try:
        load_checkpoint({"optimizer": target}, path)
    except (IncompleteCheckpointError, FileNotFoundError) as exc:
        assert same(snapshot(m), before), "a refused load changed the optimizer"
        return type(exc).__name__
    load_sharded_state_dict(m.optimizer, m.records, target)
    return global_state(build_sharded_state_dict(m.optimizer, m.records))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage,who", KILLS)
def test_async_save_killed_at_any_stage(ranks, tmp_path, stage, who):
    root = str(tmp_path)
    codes = _spawn_kill(root, stage, who)
    victim, published = STAGES[stage]
    victims = range(len(codes)) if who == "all" else [victim]
    for r, code in enumerate(codes):
        if r in victims:
            assert code == -signal.SIGKILL, codes
            continue
        assert code == 0, codes
        with open(os.path.join(root, f"outcome{r}.json")) as f:
            outcome = json.load(f)
        err = outcome["error"]
        assert err is not None, f"rank {r} believed the save succeeded"
        assert outcome["elapsed_s"] < KILL_PG_TIMEOUT_S + 20, outcome
        if published:  # what is on disk: the new checkpoint, whole
            assert "WAS published" in err and "is complete" in err, err
        else:
            assert "Nothing was published" in err or "did not reach" in err, err
            assert "WAS published" not in err, err
    step1, step2 = os.path.join(root, "step_1"), os.path.join(root, "step_2")
    pool = ranks(2)
    want1 = torch.load(os.path.join(root, "state_1.pt"), weights_only=True)
    assert all(same(o, want1) for o in pool.run(_load_state, step1)), "step_1 changed"
    got2 = pool.run(_load_state, step2)
    if published:
        want2 = torch.load(os.path.join(root, "state_2.pt"), weights_only=True)
        assert all(same(o, want2) for o in got2), "the published step_2 does not load whole"
    else:
        assert not os.path.exists(os.path.join(step2, "mfsdp_complete.json"))
        assert all(o in ("IncompleteCheckpointError", "FileNotFoundError") for o in got2), got2


def test_stage_copies_every_tensor_and_shares_nothing_mutable():
    from mfsdp_optim.checkpoint._on_disk._async import stage

    live = {
        "a": torch.arange(6.0).view(2, 3),
        "b": {"bf16": torch.ones(4, dtype=torch.bfloat16), "step": torch.tensor(3)},
        "c": [torch.zeros(0), (torch.full((2,), 5, dtype=torch.int64), "text")],
        "d": {"plain": 1.5, "obj": {"nested": [1, 2]}},
        "view": torch.arange(10.0)[::2],  # not contiguous
    }
    want = {
        "a": live["a"].clone(),
        "bf16": live["b"]["bf16"].clone(),
        "view": live["view"].clone(),
    }
    got = stage(live)
    for t in (live["a"], live["b"]["bf16"], live["b"]["step"], live["c"][1][0], live["view"]):
        t.add_(1)  # training goes on
    live["d"]["obj"]["nested"].append(3)
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["view"], want["view"])
    assert torch.equal(got["b"]["bf16"], want["bf16"]) and got["b"]["bf16"].dtype == torch.bfloat16
    assert got["b"]["step"].item() == 3 and got["b"]["step"].dim() == 0
    assert got["c"][0].shape == (0,) and torch.equal(got["c"][1][0], torch.full((2,), 5))
    assert got["c"][1][1] == "text" and got["d"] == {"plain": 1.5, "obj": {"nested": [1, 2]}}


def test_async_save_in_one_process_without_a_process_group(tmp_path):
    import warnings

    path = str(tmp_path / "one")
    state = {"w": {"exp_avg": torch.ones(4)}}
    sd = {"optimizer": {"state": state, "param_to_group_meta": {"w": {"lr": 0.1}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single..."
        handle = save_checkpoint(sd, path, asynchronous=True)
        state["w"]["exp_avg"].add_(5.0)
        assert handle.wait(timeout=60) == path and handle.done()
        target = {
            "optimizer": {
                "state": {"w": {"exp_avg": torch.zeros(4)}},
                "param_to_group_meta": {"w": {"lr": 0.0}},
            }
        }
        load_checkpoint(target, path)
    assert torch.equal(target["optimizer"]["state"]["w"]["exp_avg"], torch.ones(4))
    assert target["optimizer"]["param_to_group_meta"]["w"]["lr"] == 0.1


def test_stage_reuses_its_views_only_for_the_same_shapes():
    """The host views are kept from one save to the next: a change of shapes (same total size,
    so the same buffer), of the tensor count or of a dtype is seen; the same shapes get the new
    values, never the previous save's."""
    from mfsdp_optim.checkpoint._on_disk._async import stage

    def check(live: dict) -> dict:
        got = stage(live)
        for k, v in live.items():
            assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
            assert torch.equal(got[k], v), k
        return got

    first = check({"a": torch.arange(12.0).view(3, 4), "b": torch.arange(4.0)})
    again = check({"a": torch.arange(12.0).view(3, 4) + 7, "b": torch.arange(4.0) - 1})
    assert again["a"].data_ptr() == first["a"].data_ptr()  # the same buffer, refilled
    check({"a": torch.arange(12.0).view(4, 3), "b": torch.arange(4.0).view(2, 2)})  # reshaped
    check({"a": torch.arange(12.0).view(3, 4), "b": torch.arange(2.0), "c": torch.ones(2)})
    check({"a": torch.arange(16.0)})  # fewer tensors, same total
    check({"a": torch.arange(12.0).view(3, 4), "b": torch.arange(4, dtype=torch.int32)})


def _placement_texts(tmp: str) -> tuple[dict, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mfsdp_optim.checkpoint import RankDisagreementError
    from mfsdp_optim.checkpoint._on_disk._consensus import signatures

    mesh = init_device_mesh("cpu", (2,))
    place = {"a": [Shard(0)], "b": [Replicate()], "c": [Shard(0)], "d": [Replicate()]}
    if dist.get_rank() == 1:
        place["d"] = [Shard(0)]  # global shape (4, 2) both ways: only the placement differs
    local = {"a": (2, 2), "b": (4, 2), "c": (2, 2), "d": (4, 2) if dist.get_rank() == 0 else (2, 2)}
    sd = {
        "s": {
            k: DTensor.from_local(torch.zeros(local[k]), mesh, place[k], run_check=False)
            for k in place
        }
    }
    texts = {k: s[4] for k, s in signatures(sd, values=True).items()}
    try:
        save_checkpoint(sd, os.path.join(tmp, "placed"), asynchronous=True).wait(timeout=60)
    except RankDisagreementError as exc:
        return texts, str(exc)
    return texts, ""


def test_signatures_render_each_placement_as_its_own_text(ranks, tmp_path):
    """The placements' text is computed once per placements tuple in a call: keys of different
    placements keep different texts, and a placement differing across ranks is refused."""
    from torch.distributed.tensor import Replicate, Shard

    shard, rep = (str(Shard(0)),), (str(Replicate()),)
    out = ranks(2).run(_placement_texts, str(tmp_path))
    for rank, (texts, err) in enumerate(out):
        want = {"s.a": shard, "s.b": rep, "s.c": shard, "s.d": rep if rank == 0 else shard}
        assert texts == want, (rank, texts)
        assert "'s.d'" in err and "'s.a'" not in err, (rank, err)


def test_async_saves_in_a_row_write_each_ones_shapes_and_values(tmp_path):
    """The second save reuses the first one's host buffer (same total size): what it writes
    and loads back is its own shapes and values."""
    import warnings

    saved = [
        {"w": torch.arange(12.0).view(3, 4), "v": torch.ones(4)},
        {"w": torch.arange(12.0).view(3, 4) * 2, "v": torch.ones(4) * 3},  # same shapes
        {"w": torch.arange(12.0).view(4, 3) - 1, "v": torch.full((2, 2), 7.0)},  # reshaped
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single..."
        for i, state in enumerate(saved):
            live = {k: v.clone() for k, v in state.items()}
            handle = save_checkpoint({"s": live}, str(tmp_path / f"c{i}"), asynchronous=True)
            for v in live.values():
                v.add_(100.0)  # training goes on: not in the checkpoint
            handle.wait(timeout=60)
        for i, state in enumerate(saved):
            target = {"s": {k: torch.zeros_like(v) for k, v in state.items()}}
            load_checkpoint(target, str(tmp_path / f"c{i}"))
            for k, v in state.items():
                assert torch.equal(target["s"][k], v), (i, k)


def _staged_dtensors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mfsdp_optim.checkpoint._on_disk._async import stage

    mesh = init_device_mesh("cpu", (2,))
    r = dist.get_rank()

    def live(placements, add):
        local = torch.arange(8.0).view(2, 4) + 10 * r + add
        shape = (4, 4) if placements[0] == Shard(0) else (2, 4)
        return {
            "w": DTensor.from_local(local, mesh, placements, shape=shape, stride=(4, 1)),
            "b": torch.full((3,), float(add)),
        }

    sd = live([Shard(0)], 0)
    first = stage(sd)
    sd["w"]._local_tensor.add_(1.0)  # the same DTensor (its spec object), new values
    again = stage(sd)
    values = torch.equal(again["w"]._local_tensor, sd["w"]._local_tensor)
    other = stage(live([Replicate()], 2))  # same local shapes, another spec
    out = {
        "reused": again["w"] is first["w"],
        "values": values,
        "new_spec": other["w"] is not first["w"] and other["w"].placements == (Replicate(),),
        "new_values": torch.equal(
            other["w"]._local_tensor, torch.arange(8.0).view(2, 4) + 10 * r + 2
        ),
        "global": tuple(other["w"].shape) == (2, 4) and tuple(again["w"].shape) == (4, 4),
        "plain": torch.equal(other["b"], torch.full((3,), 2.0)),
    }
    return out


def test_stage_reuses_a_dtensor_only_for_the_same_view_and_spec(ranks):
    """The staged DTensor of the previous save is handed out again only around the same host
    view with the very same spec (its values the new copy's); another spec over the same local
    shapes gets a DTensor of its own."""
    for rank, out in enumerate(ranks(2).run(_staged_dtensors)):
        assert all(out.values()), (rank, out)


def _rank_staging_fails(root):
    from mfsdp_optim.checkpoint._on_disk import _async

    good, bad = os.path.join(root, "good"), os.path.join(root, "bad")
    m = _trained()
    want = global_state(_state(m)["optimizer"]), global_params(m)
    save_checkpoint(_state(m), good)
    real = _async.stage

    def stage(sd):
        if dist.get_rank() == 1:
            raise RuntimeError("injected: rank 1 cannot allocate its host copy")
        return real(sd)

    _async.stage = stage
    try:
        out = {"call": _timed(lambda: save_checkpoint(_state(m), bad, asynchronous=True))}
    finally:
        _async.stage = real
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    out["previous"] = same(_load_fresh(good), want)
    out["next"] = _timed(
        lambda: save_checkpoint(_state(m), bad, asynchronous=True).wait(timeout=60)
    )
    return out


@pytest.mark.timeout(120)
def test_a_staging_failure_on_one_live_rank_is_raised_by_the_call_on_every_rank(ranks, tmp_path):
    """The copy, then the one all-reduce before the call returns: a rank that cannot stage (kept
    alive) makes the call raise on every rank within seconds, nothing is left on disk, the
    previous checkpoint is untouched and the next save goes through."""
    for rank, res in enumerate(ranks(2).run(_rank_staging_fails, str(tmp_path), timeout=110)):
        name, msg, elapsed = res["call"]
        assert name == "RuntimeError" and elapsed < FAST_S, (rank, res["call"])
        assert "cannot save the checkpoint" in msg and "rank 1" in msg, (rank, msg)
        assert "cannot allocate its host copy" in msg, (rank, msg)
        assert res["listing"] == ["good"], (rank, res["listing"])
        assert res["previous"], rank
        assert res["next"] is None, (rank, res["next"])
