"""The bad-input catalogue of docs/errors.md: every refused input, each one a test.

All cases run in ONE pool run on 4 gloo ranks (the inputs need real DTensors and process groups);
each case records ``(exception class, message)`` per rank, and the parametrized test asserts one
row of docs/errors.md. A row id here is the id in the table.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# id: (exception class name, words its message must hold)
CATALOGUE = {
    # stats layer
    "S1 plain tensor grad": ("TypeError", "expected a DTensor"),
    "S2 Partial grad": ("ValueError", "Partial placement"),
    "S3 norm_type 0": ("ValueError", "norm_type must be > 0"),
    "S4 norm_type NaN": ("ValueError", "norm_type must be > 0"),
    "S5 norm_type not a number": ("TypeError", "norm_type must be a number"),
    "S6 max_norm 0": ("ValueError", "max_norm must be > 0"),
    "S7 max_norm NaN": ("ValueError", "max_norm must be > 0"),
    "S8 count_replication plain": ("TypeError", "expected a DTensor"),
    "S9 count_replication Partial": ("ValueError", "Partial"),
    "S10 mesh outside group": ("ValueError", "not in the grad-stats group"),
    "S11 bad grad on one rank, others": ("RankFailedError", "failed on rank 1 "),
    "S12 norm_type differs between ranks": ("StatsArgumentMismatchError", "different norm_type"),
    "S13 int64 grad on one rank, others": ("RankFailedError", "failed on rank 1 "),
    "S14 grads iterable raises on one rank": ("RankFailedError", "KeyError"),
    "S15 count_zeros differs between ranks": (
        "StatsArgumentMismatchError",
        "different count_zeros",
    ),
    # wrapper
    "W1 not an optimizer": ("TypeError", "must be a torch.optim.Optimizer"),
    "W2 wrapper of a wrapper": ("TypeError", "already a FullyShardedOptimizer"),
    "W3 torch GradScaler": ("TypeError", "grad_scaler must be a mfsdp_optim GradScaler"),
    "W4 plain tensor params": ("TypeError", "expected a DTensor"),
    "W5 params missing from model_chunks": ("ValueError", "missing from model_chunks"),
    "W6 colliding FQNs": ("ValueError", "colliding parameter FQNs"),
    "W7 clip_grad negative": ("ValueError", "clip_grad must be a finite number"),
    "W8 clip_grad NaN": ("ValueError", "clip_grad must be a finite number"),
    "W9 norm_type in config": ("ValueError", "norm_type must be > 0"),
    "W10 NaN lr at construction": ("ValueError", "Invalid learning rate"),
    "W11 prepare_grads twice": ("RuntimeError", "already called"),
    "W12 step_with_ready_grads first": ("RuntimeError", "call prepare_grads() first"),
    "W13 state_dict() with filter_empty_shards": ("NotImplementedError", "sharded_state_dict"),
    "W14 stats group misses ranks": ("ValueError", "misses ranks"),
    "W15 scaler state without scaler": ("ValueError", "has no grad_scaler"),
    "W17 triton_adam_step not a bool": ("TypeError", "triton_adam_step must be True or False"),
    # grad scalers
    "G1 initial_scale 0": ("ValueError", "initial_scale must be a finite number > 0"),
    "G2 initial_scale inf": ("ValueError", "initial_scale must be a finite number > 0"),
    "G3 backoff_factor 1.5": ("ValueError", "backoff_factor must be in (0, 1)"),
    "G4 growth_factor 1": ("ValueError", "growth_factor must be > 1"),
    "G5 min_scale above initial": ("ValueError", "min_scale must be > 0 and <= initial_scale"),
    "G6 hysteresis 0": ("ValueError", "hysteresis must be >= 1"),
    "G7 scaler state missing keys": ("ValueError", "is missing"),
    "G8 scaler state NaN scale": ("ValueError", "scale must be a finite number > 0"),
    "G9 scale above float32": ("ValueError", "float32's normal range"),
    "G10 scale below float32": ("ValueError", "float32's normal range"),
    "G11 initial_scale 2**200": ("ValueError", "float32's normal range"),
    "G12 hysteresis NaN": ("ValueError", "hysteresis must be an integer >= 1, got nan"),
    "G13 scaler state negative tracker": ("ValueError", "hysteresis_tracker must be >= 0"),
    "G14 scale not a number": ("TypeError", "initial_scale must be a number, got str"),
    # checkpoint layer: state dicts
    "C1 wrong top-level keys": ("StateDictMismatchError", "exactly the keys"),
    "C2 mismatched mesh/placements": ("StateDictMismatchError", "layout"),
    "C3 wrong global shape": ("StateDictMismatchError", "global shape (10, 9)"),
    "C4 unknown state shape (factored)": ("KeyspaceError", "neither the local shard's shape"),
    "C5 Partial DTensor state of another shape": ("KeyspaceError", "Partial placement"),
    "C6 non-plain hyperparameter": ("KeyspaceError", "checkpoints hold only bool"),
    "C7 state value of unknown type": ("KeyspaceError", "expected a tensor or a plain value"),
    "C8 ranks hold different state keys": ("KeyspaceError", "different state keys"),
    "C9 ranks hold different hyperparameters": ("KeyspaceError", "hyperparameters differ"),
    "C10 flattened torch state dict": ("ValueError", "flattened"),
    "C11 torch state dict with int ids": ("ValueError", "not FQNs"),
    "C12 to_torch_state_dict of another layout": ("ValueError", "expected {'state'"),
    "C13 Stateful scaler mismatch": ("ValueError", "holds no 'grad_scaler' state"),
    # checkpoint layer: directories
    "D1 foreign checkpoint (model only)": ("StateDictMismatchError", "has no entries"),
    "D2 checkpoint dtype differs": ("StateDictMismatchError", "the checkpoint holds"),
    "D3 not a checkpoint directory": ("FileNotFoundError", "not a finished DCP checkpoint"),
    "D4 incomplete (staging) directory": ("IncompleteCheckpointError", "INCOMPLETE"),
    "D5 plain DCP dir without marker": ("IncompleteCheckpointError", "require_marker=False"),
    "D6 existing directory on save": ("FileExistsError", "overwrite=True"),
    "D7 ranks disagree on save": ("RankDisagreementError", "ranks disagree"),
    "D8 malicious .metadata": ("UnsafeCheckpointError", "refused to unpickle"),
    "D9 truncated shard": ("CorruptCheckpointError", "truncated"),
    "D10 bit-flipped shard": ("CorruptCheckpointError", "checksum mismatch"),
    "D11 missing shard": ("CorruptCheckpointError", "missing file"),
    "D12 .metadata of another run": ("CorruptCheckpointError", "not the file this save wrote"),
    "D13 each rank its own save directory": ("RankDisagreementError", "checkpoint directory"),
    "D14 save into a reserved name": ("ValueError", "are reserved"),
    "D15 checkpoint keys the target lacks": ("StateDictMismatchError", "max_exp_avg_sq"),
    "D16 each rank its own load directory": ("RankDisagreementError", "checkpoint directory"),
    "W16 NaN lr set after construction": ("ValueError", "param_groups[0]['lr'] is nan"),
    "W18 NaN eps set after construction": ("ValueError", "param_groups[0]['eps'] is nan"),
    "W19 lr given as a string": ("TypeError", "param_groups[0]['lr'] is '0.1'"),
    "W20 OptimizerConfig(clip_grad=None)": ("TypeError", "OptimizerConfig.clip_grad must be"),
    "W21 cuda_graph without host_sync=False": ("ValueError", "needs host_sync=False"),
    "W22 cuda_graph over CPU params": ("ValueError", "on one CUDA device"),
    "W23 lr differs between ranks": (
        "HyperparameterMismatchError",
        "Adam param_groups[0]['lr']: 0.01 on ranks [0, 1, 3]; 0.5 on ranks [2]",
    ),
    "W24 rank_dependent_keys a bare string": ("TypeError", "(one key: ('lr',))"),
}

# inputs that are NOT refused today (see docs/errors.md, "Gaps"): strict xfail, so a fix flips it
GAPS: dict[str, tuple[str, str]] = {}


def _cases(root):  # noqa: C901 - one flat list of small cases
    import copy
    import pickle
    import shutil

    import torch.distributed as dist
    from _checkpoint_helpers import Model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import mfsdp_optim.stats as stats
    from mfsdp_optim.checkpoint import (
        OptimizerStateful,
        build_sharded_state_dict,
        from_torch_state_dict,
        load_checkpoint,
        load_sharded_state_dict,
        save_checkpoint,
        to_torch_state_dict,
    )
    from mfsdp_optim.optim import (
        ConstantGradScaler,
        DynamicGradScaler,
        FullyShardedOptimizer,
        OptimizerConfig,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,))
    g = DTensor.from_local(torch.ones(2), mesh, (Shard(0),), run_check=False)
    partial = DTensor.from_local(torch.ones(2), mesh, (Partial(),), run_check=False)
    pair = dist.new_group([0, 1])

    def wrapper(**kw):
        lin = torch.nn.Linear(4, 4, bias=False)
        lin.weight = torch.nn.Parameter(
            DTensor.from_local(torch.ones(1, 4), mesh, (Shard(0),), run_check=False)
        )
        base = torch.optim.Adam(lin.parameters(), lr=kw.pop("lr", 0.01))
        return FullyShardedOptimizer(base, model_chunks=[lin], **kw), lin

    def trained(steps=2, opt="adamw_amsgrad"):
        m = Model("fsdp", opt)
        for t in range(steps):
            m.step(t)
        return m

    def load_bad(mutate):
        m = trained()
        sd = build_sharded_state_dict(m.optimizer, m.records)
        sd = {
            "state": {f: dict(e) for f, e in sd["state"].items()},
            "param_to_group_meta": copy.deepcopy(sd["param_to_group_meta"]),
        }
        mutate(sd)
        load_sharded_state_dict(m.optimizer, m.records, sd)

    def other_layout(sd):
        v = sd["state"]["layers.0.weight"]["exp_avg"]
        sd["state"]["layers.0.weight"]["exp_avg"] = DTensor.from_local(
            torch.zeros(10, 8), v.device_mesh, (Replicate(),), run_check=False
        )

    def other_shape(sd):
        v = sd["state"]["layers.0.weight"]["exp_avg"]
        sd["state"]["layers.0.weight"]["exp_avg"] = DTensor.from_local(
            torch.zeros(v._local_tensor.shape[0], 9),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=(10, 9),
            stride=(9, 1),
        )

    def odd_state(value_fn):
        m = trained(1, "adam")
        rec = m.records[0]
        m.optimizer.state[rec.opt_param]["extra"] = value_fn(rec)
        build_sharded_state_dict(m.optimizer, m.records)

    def nan_lr_later():
        opt, lin = wrapper()
        opt.param_groups[0]["lr"] = math.nan
        lin.weight.grad = DTensor.from_local(torch.ones(1, 4), mesh, (Shard(0),), run_check=False)
        opt.step()
        if not torch.isfinite(lin.weight._local_tensor).all():
            raise AssertionError("accepted: params became NaN")

    def bad_group_value(key, value):
        opt, lin = wrapper()
        opt.param_groups[0][key] = value
        lin.weight.grad = DTensor.from_local(torch.ones(1, 4), mesh, (Shard(0),), run_check=False)
        opt.step()
        if not torch.isfinite(lin.weight._local_tensor).all():
            raise AssertionError("accepted: params became NaN")

    def ckpt_dirs(kind):
        good = os.path.join(root, "good")
        if not os.path.exists(os.path.join(good, "mfsdp_complete.json")):
            m = trained()
            save_checkpoint(
                {"optimizer": build_sharded_state_dict(m.optimizer, m.records)},
                good,
                overwrite=True,
            )
        m = trained(1)
        target = {"optimizer": build_sharded_state_dict(m.optimizer, m.records, is_loading=True)}
        path = os.path.join(root, kind)
        if rank == 0:
            if kind in ("trunc", "flip", "missing", "foreign_md", "plain", "unsafe"):
                shutil.copytree(good, path)
            shards = sorted(n for n in os.listdir(good) if n.endswith(".distcp"))
            if kind == "trunc":
                os.truncate(os.path.join(path, shards[0]), 10)
            elif kind == "flip":
                f = os.path.join(path, shards[1])
                with open(f, "rb") as fh:
                    data = bytearray(fh.read())
                data[-100] ^= 1
                with open(f, "wb") as fh:
                    fh.write(data)
            elif kind == "missing":
                os.remove(os.path.join(path, shards[2]))
            elif kind == "foreign_md":
                md = os.path.join(root, "fmd")
                import torch.distributed.checkpoint as dcp

                dcp.save({"x": torch.ones(3)}, checkpoint_id=md, no_dist=True)
                shutil.copy(os.path.join(md, ".metadata"), os.path.join(path, ".metadata"))
            elif kind == "plain":
                os.remove(os.path.join(path, "mfsdp_complete.json"))
            elif kind == "unsafe":
                os.remove(os.path.join(path, "mfsdp_complete.json"))
                with open(os.path.join(path, ".metadata"), "wb") as f:
                    pickle.dump(print, f)  # a harmless callable: still refused
            elif kind == "notckpt":
                os.makedirs(path, exist_ok=True)
            elif kind == "staging":
                os.makedirs(path + ".incomplete", exist_ok=True)
        dist.barrier()
        if kind == "model_only":
            save_checkpoint({"model": {"w": torch.ones(3)}}, path)
        if kind == "dtype":
            target["optimizer"]["state"]["layers.0.weight"]["exp_avg"] = target["optimizer"][
                "state"
            ]["layers.0.weight"]["exp_avg"].to(torch.float64)
            path = good
        if kind == "exists":
            return save_checkpoint(target, good)
        if kind == "save_per_rank":
            return save_checkpoint(target, os.path.join(root, f"{kind}{rank}"))
        if kind == "reserved":
            return save_checkpoint(target, os.path.join(root, "step_1.incomplete"))
        if kind == "load_per_rank":
            path = os.path.join(root, f"{kind}{rank}")
        if kind == "amsgrad_into_adam":
            m = trained(1, "adam")
            target = {
                "optimizer": build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
            }
            path = good
        if kind == "disagree":
            return save_checkpoint({"x": torch.tensor(float(rank))}, os.path.join(root, kind))
        kw = {"require_marker": False} if kind == "unsafe" else {}
        return load_checkpoint(target, path, **kw)

    def stateful_mismatch():
        opt, _ = wrapper(grad_scaler=ConstantGradScaler(8.0))
        OptimizerStateful(opt).load_state_dict({"optimizer": {}})

    def one_bad_rank(bad):
        stats.grad_stats([bad] if rank == 1 else [g])  # rank 1 raises its own error

    def raising_grads():
        yield g
        raise KeyError("layers.7.weight")

    cases = {
        "S1 plain tensor grad": lambda: stats.grad_stats([torch.ones(2)]),
        "S2 Partial grad": lambda: stats.grad_stats([partial]),
        "S3 norm_type 0": lambda: stats.get_grad_norm([g], norm_type=0),
        "S4 norm_type NaN": lambda: stats.get_grad_norm([g], norm_type=math.nan),
        "S5 norm_type not a number": lambda: stats.get_grad_norm([g], norm_type="two"),
        "S6 max_norm 0": lambda: stats.clip_grads_with_norm_([g], 0.0, torch.tensor(1.0)),
        "S7 max_norm NaN": lambda: stats.clip_grads_with_norm_([g], math.nan, torch.tensor(1.0)),
        "S8 count_replication plain": lambda: stats.count_replication(torch.ones(2)),
        "S9 count_replication Partial": lambda: stats.count_replication(partial),
        "S10 mesh outside group": lambda: (
            stats.grad_stats([g], group=pair)
            if rank < 2
            else (_ for _ in ()).throw(ValueError("not in the grad-stats group (not a member)"))
        ),
        "S11 bad grad on one rank, others": lambda: one_bad_rank(partial),
        "S12 norm_type differs between ranks": lambda: stats.get_grad_norm(
            [g], norm_type=math.inf if rank == 3 else 2.0
        ),
        "S13 int64 grad on one rank, others": lambda: one_bad_rank(
            DTensor.from_local(torch.ones(2, dtype=torch.int64), mesh, (Shard(0),), run_check=False)
        ),
        "S14 grads iterable raises on one rank": lambda: stats.grad_stats(
            raising_grads() if rank == 1 else [g]
        ),
        "S15 count_zeros differs between ranks": lambda: stats.grad_stats(
            [g], count_zeros=rank == 0
        ),
        "W1 not an optimizer": lambda: FullyShardedOptimizer(object()),
        "W2 wrapper of a wrapper": lambda: FullyShardedOptimizer(wrapper()[0]),
        "W3 torch GradScaler": lambda: wrapper(grad_scaler=torch.amp.GradScaler("cpu")),
        "W4 plain tensor params": lambda: FullyShardedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        ),
        "W5 params missing from model_chunks": lambda: FullyShardedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(g.detach().clone())], lr=0.1),
            model_chunks=[torch.nn.Linear(1, 1)],
        ),
        "W6 colliding FQNs": lambda: FullyShardedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(g.detach().clone())], lr=0.1),
            model_chunks=[torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)],
        ),
        "W7 clip_grad negative": lambda: OptimizerConfig(clip_grad=-1.0),
        "W8 clip_grad NaN": lambda: OptimizerConfig(clip_grad=math.nan),
        "W9 norm_type in config": lambda: OptimizerConfig(norm_type=-2),
        "W10 NaN lr at construction": lambda: wrapper(lr=math.nan),
        "W11 prepare_grads twice": lambda: _twice(wrapper, mesh),
        "W12 step_with_ready_grads first": lambda: wrapper()[0].step_with_ready_grads(),
        "W13 state_dict() with filter_empty_shards": lambda: wrapper(
            config=OptimizerConfig(filter_empty_shards=True)
        )[0].state_dict(),
        "W14 stats group misses ranks": lambda: wrapper(
            config=OptimizerConfig(grad_stats_group=pair)
        ),
        "W15 scaler state without scaler": lambda: wrapper()[0].load_grad_scaler_state_dict(
            {"scale": 2.0}
        ),
        "W17 triton_adam_step not a bool": lambda: OptimizerConfig(triton_adam_step="yes"),
        "G1 initial_scale 0": lambda: DynamicGradScaler(0.0),
        "G2 initial_scale inf": lambda: ConstantGradScaler(math.inf),
        "G3 backoff_factor 1.5": lambda: DynamicGradScaler(backoff_factor=1.5),
        "G4 growth_factor 1": lambda: DynamicGradScaler(growth_factor=1.0),
        "G5 min_scale above initial": lambda: DynamicGradScaler(4.0, min_scale=8.0),
        "G6 hysteresis 0": lambda: DynamicGradScaler(hysteresis=0),
        "G7 scaler state missing keys": lambda: DynamicGradScaler().load_state_dict({"scale": 2}),
        "G8 scaler state NaN scale": lambda: ConstantGradScaler(2.0).load_state_dict(
            {"scale": math.nan}
        ),
        "G9 scale above float32": lambda: ConstantGradScaler(1e39),
        "G10 scale below float32": lambda: ConstantGradScaler(1e-46),
        "G11 initial_scale 2**200": lambda: DynamicGradScaler(2.0**200),
        "G12 hysteresis NaN": lambda: DynamicGradScaler(hysteresis=math.nan),
        "G13 scaler state negative tracker": lambda: DynamicGradScaler().load_state_dict(
            {"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": -1}
        ),
        "G14 scale not a number": lambda: ConstantGradScaler("8"),
        "C1 wrong top-level keys": lambda: load_bad(lambda sd: sd.update(param_groups=[])),
        "C2 mismatched mesh/placements": lambda: load_bad(other_layout),
        "C3 wrong global shape": lambda: load_bad(other_shape),
        "C4 unknown state shape (factored)": lambda: odd_state(
            lambda r: torch.ones(r.param._local_tensor.shape[0] + 1)
        ),
        "C5 Partial DTensor state of another shape": lambda: odd_state(
            lambda r: DTensor.from_local(
                torch.ones(4),
                r.param.device_mesh,
                (Partial(),),
                run_check=False,
                shape=(4,),
                stride=(1,),
            )
        ),
        "C6 non-plain hyperparameter": lambda: _hyper(trained),
        "C7 state value of unknown type": lambda: odd_state(lambda r: [1, 2]),
        "C8 ranks hold different state keys": lambda: _build(
            trained(1, "sgd" if rank == 1 else "adam")
        ),
        "C9 ranks hold different hyperparameters": lambda: _lr_differs(trained, rank),
        "C10 flattened torch state dict": lambda: from_torch_state_dict(
            {"state": {"state.a.exp_avg": torch.ones(1)}, "param_groups": []}
        ),
        "C11 torch state dict with int ids": lambda: from_torch_state_dict(
            {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        ),
        "C12 to_torch_state_dict of another layout": lambda: to_torch_state_dict(
            {"state": {}, "param_groups": []}
        ),
        "C13 Stateful scaler mismatch": stateful_mismatch,
        "D1 foreign checkpoint (model only)": lambda: ckpt_dirs("model_only"),
        "D2 checkpoint dtype differs": lambda: ckpt_dirs("dtype"),
        "D3 not a checkpoint directory": lambda: ckpt_dirs("notckpt"),
        "D4 incomplete (staging) directory": lambda: ckpt_dirs("staging"),
        "D5 plain DCP dir without marker": lambda: ckpt_dirs("plain"),
        "D6 existing directory on save": lambda: ckpt_dirs("exists"),
        "D7 ranks disagree on save": lambda: ckpt_dirs("disagree"),
        "D8 malicious .metadata": lambda: ckpt_dirs("unsafe"),
        "D9 truncated shard": lambda: ckpt_dirs("trunc"),
        "D10 bit-flipped shard": lambda: ckpt_dirs("flip"),
        "D11 missing shard": lambda: ckpt_dirs("missing"),
        "D12 .metadata of another run": lambda: ckpt_dirs("foreign_md"),
        "D13 each rank its own save directory": lambda: ckpt_dirs("save_per_rank"),
        "D14 save into a reserved name": lambda: ckpt_dirs("reserved"),
        "D15 checkpoint keys the target lacks": lambda: ckpt_dirs("amsgrad_into_adam"),
        "D16 each rank its own load directory": lambda: ckpt_dirs("load_per_rank"),
        "W18 NaN eps set after construction": lambda: bad_group_value("eps", math.nan),
        "W19 lr given as a string": lambda: bad_group_value("lr", "0.1"),
        "W20 OptimizerConfig(clip_grad=None)": lambda: OptimizerConfig(clip_grad=None),
        "W21 cuda_graph without host_sync=False": lambda: OptimizerConfig(cuda_graph=True),
        "W22 cuda_graph over CPU params": lambda: wrapper(
            config=OptimizerConfig(cuda_graph=True, host_sync=False)
        ),
        "W16 NaN lr set after construction": nan_lr_later,
        "W23 lr differs between ranks": lambda: bad_group_value("lr", 0.5 if rank == 2 else 0.01),
        "W24 rank_dependent_keys a bare string": lambda: OptimizerConfig(rank_dependent_keys="lr"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = None
        dist.barrier()  # a case that desynchronised the ranks shows up here, not later
    return out


def _build(m):
    from mfsdp_optim.checkpoint import build_sharded_state_dict

    build_sharded_state_dict(m.optimizer, m.records)


def _twice(wrapper, mesh):
    from torch.distributed.tensor import DTensor, Shard

    opt, lin = wrapper()
    lin.weight.grad = DTensor.from_local(torch.ones(1, 4), mesh, (Shard(0),), run_check=False)
    opt.prepare_grads()
    opt.prepare_grads()


def _hyper(trained):
    from mfsdp_optim.checkpoint import build_sharded_state_dict

    m = trained(1, "adam")
    m.optimizer.param_groups[0]["schedule"] = object()
    build_sharded_state_dict(m.optimizer, m.records)


def _lr_differs(trained, rank):
    from mfsdp_optim.checkpoint import build_sharded_state_dict

    m = trained(1, "adam")
    m.optimizer.param_groups[0]["lr"] = 0.5 if rank == 2 else 0.01
    build_sharded_state_dict(m.optimizer, m.records)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from _ranks import get_pool

    return get_pool(4).run(_cases, str(tmp_path_factory.mktemp("catalogue")), timeout=300)


@pytest.mark.parametrize("case", sorted(CATALOGUE))
def test_refused(outcomes, case):
    for rank, out in enumerate(outcomes):
        cls, words = CATALOGUE[case]
        own = {
            "S11": ("ValueError", "Partial placement"),
            "S13": ("RuntimeError", "Long"),
            "S14": ("KeyError", "layers.7.weight"),
        }
        if case[:3] in own and rank == 1:  # the rank that passed the bad input: its own error
            cls, words = own[case[:3]]
        got = out[case]
        assert got is not None, f"rank {rank}: {case!r} was accepted"
        assert got[0] == cls and words in got[1], f"rank {rank}: {case!r} -> {got}"


@pytest.mark.skipif(not GAPS, reason="no known gaps")
@pytest.mark.parametrize("case", sorted(GAPS) or ["none"])
@pytest.mark.xfail(strict=True, reason="known gap, see docs/errors.md (needs a wrapper change)")
def test_known_gaps(outcomes, case):
    cls, words = GAPS[case]
    got = outcomes[0][case]
    assert got is not None and got[0] == cls and words in got[1], got
