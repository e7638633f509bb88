"""The checkpoint layer on real gloo ranks and real DCP files: round trips per optimizer, the
reshard matrix, partial state, keyspace consistency and its single collective, materialisation,
and refusal of bad state dicts on every rank with the optimizer untouched."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _checkpoint_helpers import (
    OPTIMIZERS,
    PARAMS,
    Model,
    global_params,
    global_state,
    reference,
    same,
    snapshot,
)
from _collectives import GATHER, counted

from mfsdp_optim.checkpoint import (
    StateDictMismatchError,
    build_sharded_state_dict,
    load_sharded_state_dict,
    prune_to_checkpoint,
)
from mfsdp_optim.checkpoint._state_dict._load_sharded_state_dict import as_format1
from mfsdp_optim.checkpoint._state_dict._table import as_table

STEPS = 2


def close(a, b) -> bool:
    """Sharded vs unsharded training: elementwise kernels may round the last bit differently on
    vector and scalar tails, so this comparison (against the reference optimizer only) allows
    float32 rounding; every save/load comparison below is bit-exact (``same``)."""
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


# ------------------------------------------------------------------------------------------
# round trip per optimizer


def _roundtrip(opt_name, path, alias):
    src = Model("fsdp", opt_name, alias=alias)
    for t in range(STEPS):
        src.step(t)
    sd = build_sharded_state_dict(src.optimizer, src.records)
    saved_state, saved_meta = global_state(sd)
    ref_state, _ = reference(opt_name, STEPS)
    assert close(saved_state, ref_state), "saved state differs from the unsharded reference"
    dcp.save({"optimizer": sd}, checkpoint_id=path)

    dst = Model("fsdp", opt_name, alias=alias, lr_scale=3.0)  # other lr: load must restore it
    target = build_sharded_state_dict(dst.optimizer, dst.records, is_loading=True)
    dcp.load({"optimizer": target}, checkpoint_id=path)
    load_sharded_state_dict(dst.optimizer, dst.records, target)
    loaded_state, loaded_meta = global_state(build_sharded_state_dict(dst.optimizer, dst.records))
    assert same(loaded_state, saved_state), "loaded state differs from the saved state"
    assert same(loaded_meta, saved_meta), f"{loaded_meta} != {saved_meta}"
    assert same(snapshot(dst)[1], snapshot(src)[1]), "param groups differ after load"
    # one more identical step on both (model weights copied, as a model checkpoint would):
    # params must stay bit-identical
    with torch.no_grad():
        for a, b in zip(dst.params, src.params, strict=True):
            a._local_tensor.copy_(b._local_tensor)
    src.step(STEPS)
    dst.step(STEPS)
    return same(global_params(src), global_params(dst)), sorted(saved_state)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_roundtrip_per_optimizer(ranks, tmp_path, opt_name):
    out = ranks(4).run(_roundtrip, opt_name, str(tmp_path), opt_name != "sgd")
    assert all(o[0] for o in out), "params diverged after the load"
    assert out[0][1] == sorted(n for n, _ in PARAMS)


# ------------------------------------------------------------------------------------------
# reshard matrix


def _save(layout, opt_name, path, skip=()):
    m = Model(layout, opt_name)
    for t in range(STEPS):
        m.step(t, skip=skip)
    sd = build_sharded_state_dict(m.optimizer, m.records)
    dcp.save({"optimizer": sd}, checkpoint_id=path)
    return global_state(sd)


def _load(layout, opt_name, path, prune=False):
    m = Model(layout, opt_name, lr_scale=2.0)
    sd = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    if prune:
        sd = prune_to_checkpoint(sd, path)
    dcp.load({"optimizer": sd}, checkpoint_id=path)
    load_sharded_state_dict(m.optimizer, m.records, sd)
    held = sorted(
        r.fqn for r in m.records if r.opt_param is not None and r.opt_param in m.optimizer.state
    )
    return global_state(build_sharded_state_dict(m.optimizer, m.records)), held


def test_reshard_matrix(ranks, tmp_path):
    fsdp4, tp2d = str(tmp_path / "fsdp4"), str(tmp_path / "tp2d")
    saved = ranks(4).run(_save, "fsdp", "adamw_amsgrad", fsdp4)[0]
    saved_2d = ranks(4).run(_save, "tp_fsdp", "adamw_amsgrad", tp2d)[0]
    ref_state, _ = reference("adamw_amsgrad", STEPS)
    for s in (saved, saved_2d):
        assert close(s[0], ref_state)
    cases = [
        (2, "fsdp", fsdp4),
        (4, "hsdp", fsdp4),
        (4, "tp_fsdp", fsdp4),
        (4, "fsdp", tp2d),
        (2, "fsdp", tp2d),
        (2, "hsdp", tp2d),
    ]
    for world, layout, path in cases:
        out = ranks(world).run(_load, layout, "adamw_amsgrad", path)
        want = saved if path == fsdp4 else saved_2d
        assert same(out[0][0], want), f"{layout} on {world} ranks from {path}"
        assert all(same(o[0], out[0][0]) for o in out)


# ------------------------------------------------------------------------------------------
# partial state: params that never stepped before the save


def test_partial_state_loads(ranks, tmp_path):
    path = str(tmp_path / "partial")
    skip = ("layers.1.bias", "tiny")
    saved = ranks(4).run(_save, "fsdp", "adam", path, skip)[0]
    assert set(saved[0]) == {n for n, _ in PARAMS} - set(skip)
    assert set(saved[1]) == {n for n, _ in PARAMS}  # hyperparameters of every param
    ref_state, _ = reference("adam", STEPS, skip)
    assert close(saved[0], ref_state)
    for world in (4, 2):
        out = ranks(world).run(_load, "fsdp", "adam", path, True)
        assert same(out[0][0], saved), world
        for (_, held), rank in zip(out, range(world), strict=True):
            assert not set(held) & set(skip), f"rank {rank} kept state for never-stepped params"


# ------------------------------------------------------------------------------------------
# keyspace: identical on every rank, learned with one collective


def _keyspace(alias, filter_empty=True):
    from torch.distributed.tensor.debug import CommDebugMode

    m = Model("fsdp", "adamw_amsgrad", alias=alias, filter_empty=filter_empty)
    for t in range(STEPS):
        m.step(t)
    with counted() as calls, CommDebugMode() as comm:
        sd = build_sharded_state_dict(m.optimizer, m.records)
    build_calls, build_functional = (
        dict(calls),
        {str(k): v for k, v in comm.get_comm_counts().items()},
    )
    keys = {
        fqn: {
            k: (type(v).__name__, str(v.dtype), tuple(v.shape), None if v.dim() else float(v))
            for k, v in e.items()
        }
        for fqn, e in sd["state"].items()
    }
    filtered = [r.fqn for r in m.records if r.opt_param is None]
    empty_locals = {
        fqn: tuple(e["exp_avg"]._local_tensor.shape)
        for fqn, e in sd["state"].items()
        if fqn in filtered
    }
    target = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    with counted() as calls:
        load_sharded_state_dict(m.optimizer, m.records, target)
    return (
        keys,
        sd["param_to_group_meta"],
        build_calls,
        build_functional,
        dict(calls),
        filtered,
        empty_locals,
    )


@pytest.mark.parametrize("filter_empty", [True, False])
@pytest.mark.parametrize("alias", [True, False])
def test_keyspace_identical_and_one_collective(ranks, alias, filter_empty):
    out = ranks(4).run(_keyspace, alias, filter_empty)
    keys0 = out[0][0]
    assert set(keys0) == {n for n, _ in PARAMS}
    if filter_empty:
        assert out[2][5] == ["tiny"] and out[3][5] == ["tiny", "layers.1.bias"]
    else:
        assert all(o[5] == [] for o in out)
    for rank, (keys, meta, build_calls, functional, load_calls, _, empty) in enumerate(out):
        # the filtered ranks derived the keys locally (zero-element step) and emit the same
        assert keys == keys0, f"rank {rank} keyspace differs"
        assert all("step" not in e for e in keys.values()), "scalars live in the leaves"
        # format 3: ONE table, identical on every rank, covering every param (the filtered
        # ranks' ones too: they got the owners' leaves from the merged keyspace)
        meta = as_table(meta)
        assert list(meta) == [n for n, _ in PARAMS], (rank, list(meta))
        assert meta.as_tuple() == as_table(out[0][1]).as_tuple()
        assert all(
            {k: v for k, v, _ in leaf[1]} == {"step": float(STEPS)} and dict(leaf[0])["amsgrad"]
            for _, leaf in meta.leaves()
        )
        # the agreement is ONE all-reduce of a fixed-size digest; with the filter on, the ranks
        # whose optimizer holds fewer params make the tables differ, so the detailed gather
        # (sizes + payload) follows; no DTensor redistribution, no per-tensor traffic; the
        # load's validity check is one all-reduce
        if filter_empty:
            assert build_calls == {"all_reduce": 1, GATHER: 2}, build_calls
            assert sum(functional.values()) == 3, functional
        else:
            assert build_calls == {"all_reduce": 1}, build_calls
            assert sum(functional.values()) == 1, functional
        assert load_calls == {"all_reduce": 1}, load_calls
        assert all(shape[0] == 0 for shape in empty.values()), empty


def _keyspace_fallback(case):
    """Ranks whose digests differ: rank 1 holds an extra param (another model), or the params
    never stepped on their owners while a filtered rank derives keys for them."""
    from mfsdp_optim._infra.params import ParamRecord

    m = Model("fsdp", "adamw_amsgrad")
    if case == "stepped":
        for t in range(STEPS):
            m.step(t)
    records = list(m.records)
    if case == "stepped" and dist.get_rank() == 1:  # a param only rank 1 has (pipeline stage)
        extra = torch.nn.Parameter(torch.zeros(4))
        m.optimizer.add_param_group({"params": [extra], "lr": 0.3})
        for r in m.records:
            if r.opt_param is not None:
                r.opt_param.grad = None  # step the extra param alone: to step STEPS as well
        for _ in range(STEPS):
            extra.grad = torch.ones(4)
            m.optimizer.step()
        from torch.distributed.tensor import DTensor, Replicate

        mesh = m.params[0].device_mesh
        records.append(
            ParamRecord(
                "rank1.extra",
                DTensor.from_local(extra.detach(), mesh, [Replicate()], run_check=False),
                extra,
            )
        )
    with counted() as calls:
        sd = build_sharded_state_dict(m.optimizer, records)
    keys = {fqn: sorted(e) for fqn, e in sd["state"].items()}
    return keys, list(sd["param_to_group_meta"]), dict(calls)


def test_keyspace_falls_back_to_detail_on_mismatch(ranks):
    out = ranks(4).run(_keyspace_fallback, "stepped")
    for rank, (keys, meta, calls) in enumerate(out):
        # one all-reduce said "differ", then the detailed gather (sizes + payload)
        assert calls == {"all_reduce": 1, GATHER: 2}, calls
        assert ("rank1.extra" in keys) == (rank == 1), (rank, sorted(keys))
        assert keys["layers.0.weight"] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        # format 3: every rank's table covers the merged keyspace, in the same order
        assert "rank1.extra" in meta and meta == out[0][1], (rank, meta)
    out = ranks(4).run(_keyspace_fallback, "never_stepped")
    for rank, (keys, meta, calls) in enumerate(out):
        # nobody stepped: the filtered ranks' derived keys disagree with the owners' (none),
        # and the owners' word wins: no state anywhere
        assert calls == {"all_reduce": 1, GATHER: 2}, calls
        assert keys == {}, (rank, keys)
        assert sorted(meta) == sorted(n for n, _ in PARAMS), (rank, meta)  # merged: all five


# ------------------------------------------------------------------------------------------
# is_loading on a fresh optimizer: state appears, nothing else moves


def _materialize(opt_name, alias):
    m = Model("fsdp", opt_name, alias=alias)
    params = global_params(m)
    _, groups = snapshot(m)
    sd = build_sharded_state_dict(m.optimizer, m.records, is_loading=True)
    assert same(global_params(m), params), "params moved"
    assert same(snapshot(m)[1], groups), "hyperparameters changed"
    # the keys a real step creates
    real = Model("fsdp", opt_name, alias=alias)
    real.step(0)
    want = build_sharded_state_dict(real.optimizer, real.records)
    return (
        {f: sorted(e) for f, e in sd["state"].items()},
        {f: sorted(e) for f, e in want["state"].items()},
        _steps(sd),
        _steps(want),
    )


def _steps(sd) -> dict[str, float]:
    """{fqn: step} for the params whose state holds a step counter (the scalars of the param's
    ``param_to_group_meta`` leaf)."""
    return {
        f: float(v)
        for f, (_, scalars) in sd["param_to_group_meta"].leaves()
        for k, v, _ in scalars
        if k == "step"
    }


def test_is_loading_materializes_without_moving(ranks):
    pool = ranks(4)
    for opt_name in sorted(OPTIMIZERS):
        for alias in (True, False) if opt_name in ("adamw", "sgd") else (True,):
            out = pool.run(_materialize, opt_name, alias)
            for got, want, steps, real_steps in out:
                assert got == want, (opt_name, got, want)
                # every FQN whose real state has a step counter has one, at 0; only SGD has none
                # (a rank emits a param's leaf only where its optimizer holds the param)
                assert set(steps) == set(real_steps) <= set(want)
                assert bool(steps) == (opt_name != "sgd"), (opt_name, steps)
                assert set(steps.values()) == ({0.0} if steps else set()), (opt_name, steps)
                # the same check on the stepped optimizer sees its step 1 (it can fail)
                assert set(real_steps.values()) == ({1.0} if steps else set()), real_steps


# ------------------------------------------------------------------------------------------
# bad state dicts: every rank raises, nothing changes


def _bad_inputs():
    import copy

    from torch.distributed.tensor import DTensor

    m = Model("fsdp", "adamw_amsgrad")
    for t in range(STEPS):
        m.step(t)
    before = snapshot(m)
    rank = dist.get_rank()

    def fresh():
        # format 1 (0.1.0's per-FQN dicts), which the load still accepts: the cases below
        # corrupt its dicts; the format-2 leaves are checked in "a (hyperparameters, scalars)"
        sd = as_format1(build_sharded_state_dict(m.optimizer, m.records))
        # detach from the live state so a wrongly applied load would show
        return {
            "state": {
                f: {
                    k: (
                        DTensor.from_local(
                            v._local_tensor.clone() + 1,
                            v.device_mesh,
                            v.placements,
                            run_check=False,
                            shape=v.shape,
                            stride=v.stride(),
                        )
                        if isinstance(v, DTensor)
                        else copy.deepcopy(v)
                    )
                    for k, v in e.items()
                }
                for f, e in sd["state"].items()
            },
            "param_to_group_meta": copy.deepcopy(sd["param_to_group_meta"]),
        }

    def wrong_shape(sd):
        v = sd["state"]["layers.0.weight"]["exp_avg"]
        sd["state"]["layers.0.weight"]["exp_avg"] = DTensor.from_local(
            torch.zeros(v._local_tensor.shape[0], 9),
            v.device_mesh,
            v.placements,
            run_check=False,
            shape=(10, 9),
            stride=(9, 1),
        )

    def wrong_dtype(sd):
        v = sd["state"]["layers.1.weight"]["exp_avg_sq"]
        sd["state"]["layers.1.weight"]["exp_avg_sq"] = v.to(torch.float64)

    cases = {
        "missing FQNs in 'param_to_group_meta'": lambda sd: sd["param_to_group_meta"].pop(
            "layers.0.bias"
        ),
        "unexpected FQNs in 'state'": lambda sd: sd["state"].update(extra={}),
        "unexpected FQNs in 'param_to_group_meta'": lambda sd: sd["param_to_group_meta"].update(
            {"nope.weight": {}}
        ),
        "missing state keys": lambda sd: sd["state"]["layers.0.weight"].pop("max_exp_avg_sq"),
        "unexpected state keys": lambda sd: sd["state"]["layers.0.bias"].update(
            momentum_buffer=sd["state"]["layers.0.bias"]["exp_avg"]
        ),
        "global shape (10, 9)": wrong_shape,
        "dtype torch.float64": wrong_dtype,
        "missing hyperparameters": lambda sd: sd["param_to_group_meta"]["layers.0.weight"].pop(
            "betas"
        ),
        "unexpected hyperparameters": lambda sd: sd["param_to_group_meta"]["layers.0.bias"].update(
            nesterov=True
        ),
        "hyperparameters in the state dict differ": lambda sd: sd["param_to_group_meta"][
            "layers.1.weight"
        ].update(lr=0.5),
        "exactly the keys": lambda sd: sd.update(param_groups=[]),
        "or a (hyperparameters, scalars) tuple (format 2)": lambda sd: sd[
            "param_to_group_meta"
        ].update({"layers.0.bias": ((), (), ())}),
    }
    messages = {}
    for expected, corrupt in cases.items():
        sd = fresh()
        if rank == 1 or expected.startswith("unexpected FQNs"):  # one bad rank is enough
            corrupt(sd)
        try:
            load_sharded_state_dict(m.optimizer, m.records, sd)
        except StateDictMismatchError as exc:
            messages[expected] = str(exc)
        else:
            messages[expected] = None
        assert same(snapshot(m), before), f"{expected}: the optimizer changed"
    # a good dict still loads afterwards (the checks above are not vacuous)
    good = fresh()
    load_sharded_state_dict(m.optimizer, m.records, good)
    changed = not same(snapshot(m), before)
    return messages, changed


def test_bad_inputs_raise_everywhere_and_change_nothing(ranks):
    out = ranks(4).run(_bad_inputs)
    for rank, (messages, changed) in enumerate(out):
        assert changed, "the control load did not apply"
        for expected, msg in messages.items():
            assert msg is not None, f"rank {rank}: {expected!r} was accepted"
            assert expected in msg, f"rank {rank}: {expected!r} not in {msg}"
            assert "nothing was loaded" in msg
