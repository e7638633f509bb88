"""Ranks agree on hyperparameters: a digest in the grad-stats row, one error on every rank.

On real gloo ranks (4): one rank sets another value for one key of one group of one base
optimizer. A hypothesis test draws the layout, the path (fused AdamW with the deferred verdict,
with a grad scaler, foreach AdamW, SGD through its own step, Muon and Adafactor on the
whole-param path, Muon + AdamW, ``host_sync=False`` with and without a scaler, the captured
step's bookkeeping), the key, the kind of value (float, int, tuple, str, None, tensor) and the
rank that differs. With the verdict read on the host every rank raises
``HyperparameterMismatchError`` within seconds, naming the key and each rank's value, with
params, state, step counters, group values and the grad scaler bit for bit as they were; with
``host_sync=False`` nothing raises, the norm is NaN and the step is skipped where it can be
(params and state unchanged). The value set back, the next step runs on every rank. Then: the
counted collectives (one per step, one object exchange more on the failure path), the
``rank_dependent_keys`` escape, the exchange's faults (a rank that fails before, during or after
it, kept alive), the digest's parts in one process (exact text, per-group recomputation, the
device digest) and the config's checks.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from _layouts import OPTIMIZER_LAYOUTS
from hypothesis import given, settings
from hypothesis import strategies as st

FAST_S = 10.0  # every rank raises within this
PATHS = (
    "fused",
    "fused-scaler",
    "foreach",
    "sgd",
    "muon",
    "adafactor",
    "several",
    "nosync-fused",
    "nosync-scaler",
    "captured",
)
# keys each class's groups hold (a custom key too), with the kinds of value drawn for them
KEYS = {
    "AdamW": {
        "lr": ("float", "int", "tensor"),
        "betas": ("tuple",),
        "weight_decay": ("float",),
        "eps": ("float",),
        "maximize": ("bool",),
        "note": ("str", "none"),
    },
    "SGD": {
        "lr": ("float", "tensor"),
        "momentum": ("float",),
        "maximize": ("bool",),
        "note": ("str", "none"),
    },
    "Muon": {
        "lr": ("float",),
        "momentum": ("float",),
        "ns_steps": ("int",),
        "nesterov": ("bool",),
        "note": ("str", "none"),
    },
    "Adafactor": {
        "lr": ("float",),
        "beta2_decay": ("float",),
        "eps": ("tuple",),
        "note": ("str", "none"),
    },
}
# the tensor kind only where the class's step takes a tensor lr on these paths
TENSOR_PATHS = {"fused", "fused-scaler", "sgd", "nosync-fused"}


def _classes(path: str) -> list[str]:
    return {
        "sgd": ["SGD"],
        "muon": ["Muon"],
        "adafactor": ["Adafactor"],
        "several": ["Muon", "AdamW"],
    }.get(path, ["AdamW"])


def _values(key: str, kind: str, base):
    """``(every rank's value, the differing rank's)`` for ``key`` of kind ``kind``."""
    if kind == "tensor":
        return torch.tensor(float(base)), torch.tensor(float(base) * 2)
    if kind == "int":
        return (5, 3) if key == "ns_steps" else (1, 2)  # lr: an int lr of 1 against 2
    if kind == "bool":
        return bool(base), not bool(base)
    if kind == "str":
        return "warmup", "decay"
    if kind == "none":
        return None, "decay"
    if kind == "tuple":
        if key == "betas":
            return (0.9, 0.999), (0.9, 0.99)
        return (None, 1e-3), (None, 2e-3)  # Adafactor's eps
    return base, (base * 0.5 if base else 0.01)  # still a valid value for the key


# ---------------------------------------------------------------------------------------------
# the ranks' side


def _bases(path, params):
    """The base optimizers of ``path`` over ``params`` (AdamW: two groups)."""
    if path == "sgd":
        return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
    if path == "muon":
        return [torch.optim.Muon(params, lr=0.02, momentum=0.9)]
    if path == "adafactor":
        return [torch.optim.Adafactor(params, lr=0.01)]
    if path == "several":
        return [
            torch.optim.Muon(params[:1], lr=0.02, momentum=0.9),
            torch.optim.AdamW(params[1:], lr=0.01, weight_decay=0.1),
        ]
    kw = {"fused": True} if path != "foreach" and path != "nosync-scaler" else {"foreach": True}
    groups = [{"params": params[:1]}] + ([{"params": params[1:]}] if len(params) > 1 else [])
    return [torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, **kw)]


def _wrapper(path, params):
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim._captured._graph import EagerRunner

    holder = torch.nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"w{i}", p)
    nosync = path.startswith("nosync") or path == "captured"
    scaler = DynamicGradScaler(2.0**4, hysteresis=1) if path.endswith("scaler") else None
    w = FullyShardedOptimizer(
        _bases(path, params),
        OptimizerConfig(clip_grad=1.0, host_sync=not nosync),
        grad_scaler=scaler,
        model_chunks=[holder],
    )
    if path == "captured":
        w.config = OptimizerConfig(clip_grad=1.0, host_sync=False, cuda_graph=True)
        w._captured = w._captured_step(runner=EagerRunner())
    return w


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _snapshot(w, params):
    """Params, every state entry, the group values and the scaler's state, copied."""
    state = [
        {k: _local(v).clone() if torch.is_tensor(v) else v for k, v in w.state.get(p, {}).items()}
        for p in params
    ]
    groups = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
        for g in w.param_groups
    ]
    scaler = w.grad_scaler_state_dict()
    return [[_local(p).clone() for p in params], state, groups, scaler]


def _same(a, b) -> bool:
    def eq(x, y):
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y)
        return x == y

    (pa, sa, ga, ca), (pb, sb, gb, cb) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
        and all(
            s.keys() == t.keys() and all(eq(s[k], t[k]) for k in s)
            for s, t in zip(sa, sb, strict=True)
        )
        and all(
            g.keys() == h.keys() and all(eq(g[k], h[k]) for k in g)
            for g, h in zip(ga, gb, strict=True)
        )
        and ca == cb
    )


def _set_grads(params, specs, step):
    """Each param's grad for ``step``, written into the grads of the step before (the captured
    step replays only while the grads stay where they are)."""
    from _layouts import build_grad

    for p, s in zip(params, specs, strict=True):
        g = build_grad(dataclasses.replace(s, seed=100 + step), check=False)
        if p.grad is None:
            p.grad = g
        else:
            p.grad._local_tensor.copy_(g._local_tensor)


def _rank_mismatch(path, specs, target, key, kind, bad_rank):
    """One example: two good steps, then rank ``bad_rank`` sets another value; what each rank
    saw, and whether everything stayed as it was."""
    import torch.distributed as dist
    from _layouts import build_grad

    rank = dist.get_rank()
    params = [
        torch.nn.Parameter(build_grad(dataclasses.replace(s, seed=i))) for i, s in enumerate(specs)
    ]
    w = _wrapper(path, params)
    opt_index, group_index = target
    group = w.optimizers[opt_index].param_groups[group_index]
    base, other = _values(key, kind, group.get(key, 0.05))
    group[key] = base  # every rank: the kind of value drawn (a tensor lr, a custom key)
    for step in range(2):
        _set_grads(params, specs, step)
        w.step()
    before = _snapshot(w, params)
    if rank == bad_rank:
        group[key] = other
    _set_grads(params, specs, 2)
    t0 = time.monotonic()
    raised, returned = None, None
    try:
        out = w.step()
        returned = tuple(None if v is None else float(v) for v in out)
    except Exception as exc:  # every rank: the same error, which the test checks
        raised = (type(exc).__name__, str(exc), getattr(exc, "differences", None))
    elapsed = time.monotonic() - t0
    if rank == bad_rank:
        group[key] = base
    after = _snapshot(w, params)
    same = _same(before, after)
    scaler_same = before[3] == after[3]
    if path.endswith("scaler"):
        before[3] = after[3] = None  # compared apart: the device verdict backs the scaler off
    unchanged = _same(before, after)
    _set_grads(params, specs, 3)
    ok = w.step()[0]
    captures = w._captured.graph.captures if path == "captured" else None
    return raised, returned, elapsed, unchanged, same, scaler_same, bool(ok), captures


@st.composite
def _examples(draw, path):
    layout = draw(st.sampled_from(sorted(OPTIMIZER_LAYOUTS)))
    specs = OPTIMIZER_LAYOUTS[layout]
    classes = _classes(path)
    opt_index = draw(st.integers(0, len(classes) - 1))
    cls = classes[opt_index]
    groups = 2 if cls == "AdamW" and path != "several" else 1
    group_index = draw(st.integers(0, groups - 1))
    key = draw(st.sampled_from(sorted(KEYS[cls])))
    kinds = [k for k in KEYS[cls][key] if k != "tensor" or path in TENSOR_PATHS]
    kind = draw(st.sampled_from(kinds))
    bad_rank = draw(st.integers(0, 3))
    return layout, specs, (opt_index, group_index), key, kind, bad_rank


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=6)
@given(data=st.data())
def test_one_rank_with_another_value_is_caught_on_every_rank(ranks, path, data):
    layout, specs, target, key, kind, bad_rank = data.draw(_examples(path))
    out = ranks(4).run(_rank_mismatch, path, specs, target, key, kind, bad_rank, timeout=120)
    device_verdict = path.startswith("nosync") or path == "captured"
    for rank, (raised, returned, elapsed, unchanged, same, scaler_same, ok, captures) in enumerate(
        out
    ):
        where = f"rank {rank} ({path}, {layout}, {key}={kind}, rank {bad_rank} differs)"
        assert elapsed < FAST_S, (where, elapsed)
        assert ok, f"{where}: the step after the value was set back failed"
        if device_verdict:
            assert raised is None, (where, raised)
            assert math.isnan(returned[1]), (where, returned)
            assert unchanged, f"{where}: a skipped step changed params, state or groups"
            assert returned[0] == 0.0, (where, returned)  # update_successful: False
            assert path != "captured" or captures, (where, "the step was never captured")
            continue
        assert raised is not None, f"{where}: the mismatch was not caught"
        name, message, differences = raised
        assert name == "HyperparameterMismatchError", (where, raised)
        assert same and scaler_same, f"{where}: a refused step changed something"
        assert f"param_groups[{target[1]}][{key!r}]" in message, (where, message)
        assert f"on ranks [{bad_rank}]" in message, (where, message)
        assert "Nothing was updated" in message
        assert message == out[0][0][1], "ranks raised different messages"
        (place, values), *_ = differences
        assert key in place and set(values) == {0, 1, 2, 3}, differences
        assert len({values[r] for r in range(4) if r != bad_rank}) == 1, values
        assert values[bad_rank] != values[(bad_rank + 1) % 4], values


# ---------------------------------------------------------------------------------------------
# the message: every kind of difference at once, every rank the same words


def _rank_many_differences():
    """Rank 1 differs in a float, a tuple, a tensor, a str, a None and a missing key; rank 2
    has an extra param group; rank 3 agrees with rank 0."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import FullyShardedOptimizer

    rank = dist.get_rank()
    mesh = get_mesh((4,))

    def param():
        return torch.nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]))

    ps = [param(), param()]
    groups = [{"params": ps[:1]}] + ([{"params": ps[1:]}] if rank == 2 else [])
    opt = torch.optim.AdamW(groups, lr=0.01, fused=True)
    g = opt.param_groups[0]
    g["lr"] = torch.tensor(0.02 if rank == 1 else 0.01)
    g["betas"] = (0.8, 0.999) if rank == 1 else (0.9, 0.999)
    g["weight_decay"] = 0.5 if rank == 1 else 0.1
    g["schedule"] = "cosine" if rank == 1 else "linear"
    g["tag"] = None if rank == 1 else "run-7"
    if rank != 1:
        g["extra"] = 3
    w = FullyShardedOptimizer(opt)
    for p in ps:
        p.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    try:
        w.step()
    except Exception as exc:  # every rank: the same error
        return type(exc).__name__, str(exc), exc.differences  # type: ignore[attr-defined]
    return None


def test_the_message_names_every_difference_and_each_ranks_value(ranks):
    out = ranks(4).run(_rank_many_differences)
    name, message, differences = out[0]
    assert all(o == out[0] for o in out), "ranks raised different errors"
    assert name == "HyperparameterMismatchError"
    want = {
        "AdamW: its number of param groups": {0: "1", 1: "1", 2: "2", 3: "1"},
        "AdamW param_groups[0]['betas']": {
            0: "(0.9, 0.999)",
            1: "(0.8, 0.999)",
            2: "(0.9, 0.999)",
            3: "(0.9, 0.999)",
        },
        "AdamW param_groups[0]['extra']": {0: "3", 1: "absent", 2: "3", 3: "3"},
        "AdamW param_groups[0]['schedule']": {
            0: "'linear'",
            1: "'cosine'",
            2: "'linear'",
            3: "'linear'",
        },
        "AdamW param_groups[0]['tag']": {0: "'run-7'", 1: "None", 2: "'run-7'", 3: "'run-7'"},
        "AdamW param_groups[0]['weight_decay']": {0: "0.1", 1: "0.5", 2: "0.1", 3: "0.1"},
    }
    got = dict(differences)
    lr = got.pop("AdamW param_groups[0]['lr']")
    assert got == want, got
    f32 = [float(torch.tensor(v)) for v in (0.01, 0.02)]
    assert lr[0] == lr[2] == lr[3] == f"tensor({f32[0]!r}, dtype=torch.float32, device=cpu)", lr
    assert lr[1] == f"tensor({f32[1]!r}, dtype=torch.float32, device=cpu)", lr
    assert "AdamW param_groups[0]['weight_decay']: 0.1 on ranks [0, 2, 3]; 0.5 on ranks [1]" in (
        message
    )
    assert "AdamW: its number of param groups: 1 on ranks [0, 1, 3]; 2 on ranks [2]" in message
    assert "OptimizerConfig(rank_dependent_keys=...)" in message


# ---------------------------------------------------------------------------------------------
# the collectives: one per step, the exchange only on the failure path


def _rank_counted(path, differ):
    import torch.distributed as dist
    from _collectives import counted
    from _layouts import build_grad

    from mfsdp_optim.optim import _agreed  # noqa: F401  (imported before counting)

    specs = OPTIMIZER_LAYOUTS["1d-uneven-empty"]
    params = [
        torch.nn.Parameter(build_grad(dataclasses.replace(s, seed=i))) for i, s in enumerate(specs)
    ]
    w = _wrapper(path, params)
    for g in w.param_groups:
        if path in TENSOR_PATHS:
            g["lr"] = torch.tensor(float(g["lr"]))  # a tensor lr, digested every step
    counts = []
    for step in range(3):
        if differ and step == 2 and dist.get_rank() == 1:
            w.param_groups[0]["weight_decay"] = 0.3
        _set_grads(params, specs, step)
        with counted() as c:
            try:
                w.step()
            except Exception as exc:  # the failure path: checked by the test
                c["raised"] = type(exc).__name__  # type: ignore[assignment]
        counts.append(dict(c))
    return counts


@pytest.mark.parametrize("path", ["fused", "foreach", "sgd", "several", "nosync-fused"])
def test_one_collective_per_step_and_an_exchange_only_on_a_mismatch(ranks, path):
    from _collectives import GATHER

    for counts in ranks(4).run(_rank_counted, path, False):
        if path == "several":  # Muon's plan (its first step) and exchanges: not all-gathers
            assert [c[GATHER] for c in counts[1:]] == [1, 1], counts
        else:
            assert counts == [{GATHER: 1}] * 3, counts
    for counts in ranks(4).run(_rank_counted, path, True):
        *healthy, failed = counts
        assert all(c[GATHER] == 1 for c in healthy[path == "several" :]), counts
        if path == "nosync-fused":  # no host read, no exchange: the step is skipped instead
            assert failed == {GATHER: 1}, failed
        else:  # the stats row, then the exchange: sizes and payloads (two all-gathers)
            assert failed == {GATHER: 3, "raised": "HyperparameterMismatchError"}, failed


# ---------------------------------------------------------------------------------------------
# the escape: keys whose values may differ on purpose


def _rank_escape(keys, lr_differs):
    """SGD (lr only): each rank's shard moves by its own lr where ``lr`` is allowed to differ."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    rank = dist.get_rank()
    mesh = get_mesh((4,))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)]))
    lr = 0.25 * (rank + 1) if lr_differs else 0.5
    config = OptimizerConfig(rank_dependent_keys=keys if rank != 3 or lr_differs else ())
    w = FullyShardedOptimizer(torch.optim.SGD([p], lr=lr), config)
    p.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    try:
        w.step()
    except Exception as exc:  # the test checks which
        return type(exc).__name__, str(exc)
    return p._local_tensor.tolist()


def test_rank_dependent_keys_let_named_keys_differ(ranks):
    out = ranks(4).run(_rank_escape, ["lr"], True)
    for rank, local in enumerate(out):
        assert local == [[-0.25 * (rank + 1)] * 3] * 2, (rank, local)  # its own lr
    # rank 3 without the option: the option itself is compared, and named
    for name, message in ranks(4).run(_rank_escape, ["lr", "note"], False):
        assert name == "HyperparameterMismatchError", message
        assert (
            "OptimizerConfig.rank_dependent_keys: ['lr', 'note'] on ranks [0, 1, 2]; [] on ranks"
            " [3]" in message
        ), message


# ---------------------------------------------------------------------------------------------
# faults on the failure path's exchange: the failing rank kept alive (it returns normally)

FAULTY = 2


def _rank_exchange_fault(when):
    """Rank 1 holds another lr; rank FAULTY fails: computing its digest (``digest``, before the
    stats collective), or ``when`` the exchange of the failure path runs: ``before`` (it cannot
    describe its values), ``during`` (after the exchange's collectives, inside it), ``after``
    (building the message). Then every rank steps again with equal values."""
    import torch.distributed as dist
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import FullyShardedOptimizer
    from mfsdp_optim.optim import _agreed

    rank = dist.get_rank()
    mesh = get_mesh((4,))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)]))
    w = FullyShardedOptimizer(torch.optim.SGD([p], lr=0.2 if rank == 1 else 0.1))
    p.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    saved = _agreed.AgreedSlots.describe, _agreed.agree, _agreed.mismatch_error
    saved_values = _agreed.AgreedSlots.values

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected fault ({when})")

    def agree_then_fail(*args, **kwargs):
        saved[1](*args, **kwargs)
        boom()

    if rank == FAULTY:
        if when == "digest":
            _agreed.AgreedSlots.values = boom  # type: ignore[method-assign]
        elif when == "before":
            _agreed.AgreedSlots.describe = boom  # type: ignore[method-assign]
        elif when == "during":
            _agreed.agree = agree_then_fail
        else:
            _agreed.mismatch_error = boom
    before = p._local_tensor.clone()
    t0 = time.monotonic()
    try:
        w.step()
        raised = None
    except Exception as exc:  # kept alive, as a job that logs would
        raised = (type(exc).__name__, str(exc))
    finally:
        _agreed.AgreedSlots.describe, _agreed.agree, _agreed.mismatch_error = saved
        _agreed.AgreedSlots.values = saved_values  # type: ignore[method-assign]
    elapsed = time.monotonic() - t0
    unchanged = torch.equal(p._local_tensor, before)
    w.param_groups[0]["lr"] = 0.1
    ok = w.step()[0]
    return raised, elapsed, unchanged, ok, p._local_tensor.tolist()


@pytest.mark.parametrize("when", ["digest", "before", "during", "after"])
def test_a_rank_failing_in_the_exchange_never_hangs_the_others(ranks, when):
    out = ranks(4).run(_rank_exchange_fault, when, timeout=60)
    step = -float(torch.tensor(0.1))  # SGD's lr times the grad, in float32
    for rank, (raised, elapsed, unchanged, ok, local) in enumerate(out):
        assert elapsed < FAST_S, (rank, elapsed)
        assert unchanged and ok, (rank, unchanged, ok)
        assert local == [[step] * 3] * 2, (rank, local)  # the next step ran, in step
        name, message = raised
        if rank == FAULTY:
            assert (name, message) == ("RuntimeError", f"injected fault ({when})")
        elif when in ("digest", "before"):
            assert name == "RankFailedError" and f"failed on rank {FAULTY} " in message, raised
            assert f"injected fault ({when})" in message, message
        else:
            assert name == "HyperparameterMismatchError", raised
            assert "SGD param_groups[0]['lr']: 0.1 on ranks [0, 2, 3]; 0.2 on ranks [1]" in message


# ---------------------------------------------------------------------------------------------
# the digest's parts, in one process


def test_exact_text_of_a_value():
    from mfsdp_optim.optim._agreed import canonical

    def text(v):
        return canonical(v, [])

    assert text(1) == text(1.0) and text(True) != text(1)
    assert text((0.9, 0.999)) == text([0.9, 0.999]) != text((0.9, 0.99))
    assert text(float("nan")) == text(float("nan")) and text(0.0) != text(-0.0)
    assert text(torch.tensor(0.1)) != text(0.1)
    assert text(torch.tensor([1.0, 2.0])) != text(torch.tensor([1.0, 3.0]))
    assert text(torch.tensor(1.0)) != text(torch.tensor(1.0, dtype=torch.float64))
    assert text(None) != text("None") and text({"a": 1, "b": 2}) == text({"b": 2.0, "a": 1})
    assert text(object()) == text(object())  # a memory address is not a value
    devices: list[torch.Tensor] = []
    meta = torch.empty(3, device="meta")
    assert "meta" in canonical(meta, devices)
    assert len(devices) == 1 and devices[0].device == meta.device  # values: on the device


def test_a_group_is_digested_again_only_when_its_values_changed():
    from mfsdp_optim.optim._agreed import GroupDigests

    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.AdamW([{"params": [p]} for p in ps], lr=0.1)
    digests = GroupDigests(opt, frozenset())
    done: list[int] = []
    real = digests._digest

    def counting(group):
        done.append([g is group for g in opt.param_groups].index(True))
        return real(group)

    digests._digest = counting  # type: ignore[method-assign]
    assert digests.update() and done == [0, 1, 2]
    assert not digests.update() and done == [0, 1, 2]  # nothing changed: nothing digested
    first = digests.text()
    opt.param_groups[1]["lr"] = 0.2
    assert digests.update() and done[3:] == [1] and digests.text() != first
    opt.param_groups[1]["lr"] = 0.1  # back: the same digest as before
    assert digests.update() and done[4:] == [1] and digests.text() == first
    opt.param_groups[2]["note"] = "x"  # a new key
    assert digests.update() and done[5:] == [2]
    opt.param_groups[0]["lr"] = torch.tensor(0.1)  # may change in place: every update
    digests.update(), digests.update()
    assert done[6:] == [0, 0]


def _reference_digest(tensors, base):
    """The device digest by hand: each element's bit pattern (struct), sum of b**(i+1) * x."""
    import struct

    formats = {torch.float32: "f", torch.float64: "d", torch.int64: "q", torch.bfloat16: None}
    prime, total, i = 2**31 - 1, 0, 0
    for t in tensors:
        for x in t.reshape(-1).tolist():
            if t.dtype == torch.bfloat16:  # the upper half of the float32 pattern
                bits = struct.unpack("<i", struct.pack("<f", x))[0] >> 16
            else:
                fmt = formats[t.dtype]
                bits = struct.unpack(
                    f"<{fmt.replace('f', 'i').replace('d', 'q')}", struct.pack(f"<{fmt}", x)
                )[0]
            i += 1
            total += pow(base, i, prime) * (bits % prime)
    return float(total % prime)


def test_the_device_digest_is_exact_and_tells_values_apart():
    from mfsdp_optim.optim._agreed import _BASES, device_digest

    gen = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(5, generator=gen),
        torch.tensor(0.1, dtype=torch.float64),
        torch.randn(3, generator=gen).to(torch.bfloat16),
        torch.tensor([-7, 2**40], dtype=torch.int64),
    ]
    got = device_digest(ts, torch.device("cpu")).tolist()
    assert got == [_reference_digest(ts, b) for b in _BASES]
    flipped = [t.clone() for t in ts]
    flipped[0][2] = torch.nextafter(flipped[0][2], torch.tensor(10.0))  # one ulp
    swapped = [ts[0].flip(0), *ts[1:]]
    for other in (flipped, swapped):
        d = device_digest(other, torch.device("cpu")).tolist()
        assert d[0] != got[0] and d[1] != got[1]
    odd = [torch.tensor([True, False]), torch.tensor(1 + 2j), torch.tensor(3, dtype=torch.uint8)]
    assert device_digest(odd, torch.device("cpu")).shape == (2,)  # every dtype has a pattern


def test_the_row_reads_one_buffer_uploaded_only_when_a_value_changed(monkeypatch):
    from mfsdp_optim.optim import _agreed

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    slots = _agreed.AgreedSlots([opt], ())
    uploads: list[float] = []
    real = _agreed.staged_for

    def staged(device, values, dtype):
        uploads.extend(values)
        return real(device, values, dtype)

    monkeypatch.setattr(_agreed, "staged_for", staged)
    monkeypatch.setattr(_agreed, "collective_device", lambda group: torch.device("cpu"))
    first = slots.values(None)
    assert slots.values(None) is first is slots.buffer and len(uploads) == 1
    before = first.tolist()
    opt.param_groups[0]["lr"] = 0.2  # a schedule: the same buffer, a new digest in it
    assert slots.refresh(None) is first and len(uploads) == 2
    assert first.tolist()[0] != before[0] and first.tolist()[1:] == [0.0, 0.0]
    lr = opt.param_groups[0]["lr"] = torch.tensor(0.2)  # a CPU tensor: read at every step
    digests = [slots.values(None).tolist()[0]]
    lr.fill_(0.3)  # in place, as a scheduler of a tensor lr does
    digests.append(slots.values(None).tolist()[0])
    assert digests[0] != digests[1] and len(uploads) == 4


def test_rank_dependent_keys_is_checked():
    from mfsdp_optim import OptimizerConfig

    assert OptimizerConfig(rank_dependent_keys={"lr", "eps"}).rank_dependent_keys == ("eps", "lr")
    with pytest.raises(TypeError, match=r"got 'lr' \(one key: \('lr',\)\)"):
        OptimizerConfig(rank_dependent_keys="lr")
    with pytest.raises(TypeError, match="holds 3, not a string"):
        OptimizerConfig(rank_dependent_keys=["lr", 3])
    with pytest.raises(ValueError, match="names 'params'"):
        OptimizerConfig(rank_dependent_keys=["params"])


# ---------------------------------------------------------------------------------------------
# the captured step's bookkeeping reads the digest buffer; a changed lr reaches it


def _rank_captured_buffer():
    """``cuda_graph=True`` on CPU through an ``EagerRunner`` (the body runs again at each
    replay): a NaN written into the digest buffer makes the replayed verdict fail (NaN differs
    from itself), so the update is skipped, until a changed lr uploads a new digest over it."""
    specs = OPTIMIZER_LAYOUTS["1d-uneven-empty"]
    params = [torch.nn.Parameter(_spec_param(s, i)) for i, s in enumerate(specs)]
    w = _wrapper("captured", params)
    out = []
    for step in range(6):
        _set_grads(params, specs, step)
        before = [_local(p).clone() for p in params]
        if step == 2:
            w._agreement.buffer[0] = float("nan")
        if step == 4:
            w.param_groups[0]["lr"] = 5e-3
        ok, norm, _ = w.step()
        moved = not all(torch.equal(a, _local(p)) for a, p in zip(before, params, strict=True))
        out.append((bool(ok), math.isfinite(float(norm)), moved))
    graph = w._captured.graph
    holds = any(_local(p).numel() for p in params)  # the layout leaves rank 3 empty shards
    return out, graph.captures, graph.replays, holds


def _spec_param(spec, seed):
    from _layouts import build_grad

    return build_grad(dataclasses.replace(spec, seed=seed))


def test_the_captured_step_reads_the_digest_buffer_a_changed_lr_updates(ranks):
    for out, captures, replays, holds in ranks(4).run(_rank_captured_buffer):
        assert captures == 1 and replays == 5, (captures, replays)
        assert out[2] == out[3] == (False, False, False), out  # replayed, skipped
        assert out[4] == out[5] == (True, True, holds), out
