"""How the wrapper treats optimizer classes it does not know, hyperparameters, lr schedulers,
``step(closure)`` and several base optimizers, on real gloo ranks against unsharded references.

* Unknown classes: one whose update reads the whole param (``p -= lr * g / ||g||``) is exact and
  warned about; declared elementwise, it is stepped on local shards and wrong (the comparison
  is live); an elementwise one (sign-SGD) declared elementwise is exact.
* Hyperparameters: typed from each class's defaults; a bad value raises naming
  ``param_groups[i][key]`` with params, state and grads as they were.
* ``OptimizerConfig(update_kinds=...)`` validation; lr schedulers on the wrapper and on each
  base optimizer; ``step(closure)``; the errors of a chain (overlap, ``optimizer``,
  ``state_dict()``, ``add_param_group``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from _layouts import OPTIMIZER_LAYOUTS, GradSpec, PlacementSpec, global_tensor, stripe_of, stripes

S = PlacementSpec("S", 0)
LAYOUTS = OPTIMIZER_LAYOUTS
# the chain's params: 1-D over 4 ranks (uneven and empty shards), all 2-D so Muon takes any
CHAIN = LAYOUTS["1d-uneven-empty"] + [GradSpec((4, 4), (4,), (0,), (S,))]
MUON = dict(lr=0.02, momentum=0.9, weight_decay=0.01)
ADAMW = dict(lr=0.01, weight_decay=0.1)
LR, STEPS = 0.1, 3


class NormSGD(torch.optim.Optimizer):
    """``p -= lr * g / ||g||``: the update reads the whole grad (its norm)."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / torch.linalg.vector_norm(p.grad))


class SignSGD(torch.optim.Optimizer):
    """``p -= lr * sign(g)``: elementwise."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


CUSTOM = {"NormSGD": NormSGD, "SignSGD": SignSGD}


def _seeded(specs, salt):
    return [dataclasses.replace(s, seed=1000 * i + salt) for i, s in enumerate(specs)]


def _dparams(specs):
    from _layouts import build_grad

    return [torch.nn.Parameter(build_grad(s)) for s in _seeded(specs, 1)]


def _set_grads(params, specs, step, scale=1.0):
    from _layouts import build_grad

    for p, s in zip(params, _seeded(specs, 100 + step), strict=True):
        p.grad = build_grad(s, check=False)
        if scale != 1.0:
            p.grad._local_tensor.mul_(scale)


# ---------------------------------------------------------------------------------------------
# unknown classes


def _rank_custom(specs, name, declare):
    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    # a fresh class per call: the package warns once per class and process
    cls = type(name, (CUSTOM[name],), {})
    params = _dparams(specs)
    kinds = {cls: declare} if declare else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = FullyShardedOptimizer(cls(params, lr=LR), OptimizerConfig(update_kinds=kinds))
        for step in range(STEPS):
            _set_grads(params, specs, step)
            ok, _, _ = opt.step()
            assert ok
            opt.zero_grad()
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return [p.detach().full_tensor() for p in params], [n for n in notes if "update_kinds" in n]


def _custom_reference(specs, name):
    """{(param index, stripe): param} of the class on the unsharded params."""
    out = {}
    for i, spec in enumerate(_seeded(specs, 1)):
        for stripe in stripes(spec):
            p = torch.nn.Parameter(global_tensor(spec, stripe).clone())
            opt = CUSTOM[name]([p], lr=LR)
            for step in range(STEPS):
                p.grad = global_tensor(_seeded(specs, 100 + step)[i], stripe).clone()
                opt.step()
            out[(i, stripe)] = p.detach()
    return out


def _check_exact(results, specs, ref):
    for rank, (params, _) in enumerate(results):
        for i, spec in enumerate(specs):
            want = ref[(i, stripe_of(rank, spec))]
            assert torch.equal(params[i], want), f"rank {rank}, param {i}: params differ"


@pytest.mark.parametrize("layout", ["1d-uneven-empty", "2d-shard-shard", "dense+expert"])
def test_unknown_whole_param_class_is_exact_and_warned(ranks, layout):
    specs = LAYOUTS[layout]
    results = ranks(4).run(_rank_custom, specs, "NormSGD", None)
    _check_exact(results, specs, _custom_reference(specs, "NormSGD"))
    for rank, (_, notes) in enumerate(results):
        assert len(notes) == 1, (rank, notes)
        assert "NormSGD" in notes[0] and "OptimizerConfig(update_kinds=" in notes[0], notes[0]
        assert "'elementwise'" in notes[0]


def test_whole_param_class_declared_elementwise_is_stepped_on_shards(ranks):
    """Wrongly declared elementwise, NormSGD divides each local shard by the local norm: not
    the unsharded result (this is what the exact check above would catch), and no warning."""
    specs = LAYOUTS["1d-uneven-empty"]
    results = ranks(4).run(_rank_custom, specs, "NormSGD", "elementwise")
    ref = _custom_reference(specs, "NormSGD")
    with pytest.raises(AssertionError, match="params differ"):
        _check_exact(results, specs, ref)
    params, notes = results[0]
    assert notes == []
    worst = max(
        float((params[i] - ref[(i, ())]).norm() / (ref[(i, ())] - global_tensor(s, ())).norm())
        for i, s in enumerate(_seeded(specs, 1))
    )
    assert worst > 0.1, worst  # the change itself is off, not a rounding


@pytest.mark.parametrize("declare", ["elementwise", None])
def test_unknown_elementwise_class_is_exact(ranks, declare):
    """sign-SGD: on local shards when declared elementwise (no warning), on whole params (with
    the warning) when not; exact either way."""
    specs = LAYOUTS["dense+expert"]
    results = ranks(4).run(_rank_custom, specs, "SignSGD", declare)
    _check_exact(results, specs, _custom_reference(specs, "SignSGD"))
    for _, notes in results:
        assert len(notes) == (0 if declare else 1), notes


# ---------------------------------------------------------------------------------------------
# OptimizerConfig(update_kinds=...) and mfsdp_update_kind


def test_update_kinds_validation():
    from mfsdp_optim.optim import OptimizerConfig

    with pytest.raises(TypeError, match=r"update_kinds must be a mapping.*got list"):
        OptimizerConfig(update_kinds=[(NormSGD, "elementwise")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys must be torch.optim.Optimizer classes.*'NormSGD'"):
        OptimizerConfig(update_kinds={"NormSGD": "elementwise"})
    with pytest.raises(TypeError, match=r"keys must be torch.optim.Optimizer classes.*int"):
        OptimizerConfig(update_kinds={int: "elementwise"})
    with pytest.raises(TypeError, match="keys must be torch.optim.Optimizer classes"):
        OptimizerConfig(update_kinds={NormSGD([torch.zeros(1)]): "elementwise"})
    with pytest.raises(
        ValueError,
        match=r"update_kinds\[NormSGD\] is 'whole'; it must be one of "
        r"\['elementwise', 'whole_param', 'cross_param'\]",
    ):
        OptimizerConfig(update_kinds={NormSGD: "whole"})
    with pytest.raises(ValueError, match=r"update_kinds\[SignSGD\] is None"):
        OptimizerConfig(update_kinds={SignSGD: None})
    ok = OptimizerConfig(update_kinds={NormSGD: "whole_param", SignSGD: "elementwise"})
    assert ok.update_kinds == {NormSGD: "whole_param", SignSGD: "elementwise"}


def test_bad_mfsdp_update_kind_attribute_is_refused():
    from mfsdp_optim.optim import FullyShardedOptimizer

    class Odd(SignSGD):
        mfsdp_update_kind = "sometimes"

    with pytest.raises(ValueError, match=r"Odd.mfsdp_update_kind is 'sometimes'; it must be one"):
        FullyShardedOptimizer(Odd([torch.nn.Parameter(torch.zeros(2))]))


# ---------------------------------------------------------------------------------------------
# the chain: Muon (params 0, 1) and AdamW (two groups: param 2; param 3 with its own lr)


def _chain_bases(params):
    return [
        torch.optim.Muon(params[:2], **MUON),
        torch.optim.AdamW([{"params": [params[2]]}, {"params": [params[3]], "lr": 0.02}], **ADAMW),
    ]


def _chain(params, grad_scaler=None):
    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    holder = torch.nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"w{i}", p)
    return FullyShardedOptimizer(
        _chain_bases(params),
        OptimizerConfig(clip_grad=0.0),
        grad_scaler=grad_scaler,
        model_chunks=[holder],
    )


def _chain_reference(steps, schedulers=None, grads_at=None):
    """The unsharded chain; ``schedulers(bases)`` -> schedulers stepped after each step;
    ``grads_at(step)`` -> the grads' salt (default: the step)."""
    params = [torch.nn.Parameter(global_tensor(s, ()).clone()) for s in _seeded(CHAIN, 1)]
    bases = _chain_bases(params)
    scheds = schedulers(bases) if schedulers else []
    lrs = []
    for step in range(steps):
        salt = grads_at(step) if grads_at else step
        for p, s in zip(params, _seeded(CHAIN, 100 + salt), strict=True):
            p.grad = global_tensor(s, ()).clone()
        for o in bases:
            o.step()
            o.zero_grad()
        for sc in scheds:
            sc.step()
        lrs.append([g["lr"] for o in bases for g in o.param_groups])
    return [p.detach() for p in params], lrs


def _close(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            g, w, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"{what} {i}: {m}"
        )


# ---------------------------------------------------------------------------------------------
# hyperparameter checks


def _snapshot(opt, params):
    state = [
        {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in opt.state[p].items()}
        for p in params
    ]
    grads = [p.grad.full_tensor() for p in params]
    return [p.full_tensor() for p in params], state, grads


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _rank_bad_hyper(which, gi, key, value):
    """One good step, then a bad ``key`` in base optimizer ``which``'s group ``gi``: the step
    raises; params, state and grads are as they were; the good value back, the step goes on as
    if nothing had happened. A grad scaler of 4 (unscaling is exact)."""
    from mfsdp_optim import ConstantGradScaler

    params = _dparams(CHAIN)
    opt = _chain(params, ConstantGradScaler(4.0))
    _set_grads(params, CHAIN, 0, scale=4.0)
    assert opt.step()[0]
    opt.zero_grad()
    group = opt.optimizers[which].param_groups[gi]
    good = group[key]
    group[key] = value
    _set_grads(params, CHAIN, 1, scale=4.0)
    before = _snapshot(opt, params)
    try:
        opt.step()
    except (TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    after = _snapshot(opt, params)
    unchanged = [_same(x, y) for x, y in zip(before, after, strict=True)]  # params, state, grads
    group[key] = good
    assert opt.step()[0]  # the same grads, as a user who fixed the value would step again
    return error, unchanged, [p.full_tensor() for p in params]


BAD = [
    # (base optimizer, group, key, value, error type, what the message says)
    (1, 1, "lr", float("nan"), "ValueError", "param_groups[1]['lr'] is nan"),
    (1, 0, "lr", "0.01", "TypeError", "param_groups[0]['lr'] is '0.01' (str); it must be a number"),
    (0, 0, "lr", "0.02", "TypeError", "param_groups[0]['lr'] is '0.02' (str)"),
    (1, 1, "weight_decay", True, "TypeError", "param_groups[1]['weight_decay'] is True (bool)"),
    (0, 0, "nesterov", 1, "TypeError", "param_groups[0]['nesterov'] is 1 (int); it must be a bool"),
    (1, 0, "betas", (0.9,), "TypeError", "param_groups[0]['betas'] is (0.9,); it must be a tuple"),
    (0, 0, "ns_coefficients", (3.4, -4.7), "TypeError", "['ns_coefficients'] is (3.4, -4.7)"),
]
ARGS = ("which", "gi", "key", "value", "etype", "says")
# every engine is checked before any grad is unscaled (a failed prepare changes no grad)
BAD_AFTER = BAD


@pytest.mark.parametrize(ARGS, BAD, ids=repr)
def test_bad_hyperparameter_raises_and_changes_nothing(ranks, which, gi, key, value, etype, says):
    for rank, (error, unchanged, _) in enumerate(
        ranks(4).run(_rank_bad_hyper, which, gi, key, value)
    ):
        assert error is not None, f"rank {rank}: no error for {key}={value!r}"
        assert error.startswith(etype + ":") and says in error, (rank, error)
        assert "Fix the value" in error
        assert unchanged[:2] == [True, True], f"rank {rank}: params, state: {unchanged[:2]}"


@pytest.mark.parametrize(ARGS, BAD_AFTER, ids=repr)
def test_bad_hyperparameter_leaves_the_grads_and_the_retry_exact(
    ranks, which, gi, key, value, etype, says
):
    """Under a grad scaler: the grads are as they were, and the step retried with the value
    fixed is the unsharded chain's second step."""
    ref, _ = _chain_reference(2)
    for rank, (_, unchanged, params) in enumerate(
        ranks(4).run(_rank_bad_hyper, which, gi, key, value)
    ):
        assert unchanged[2], f"rank {rank}: the grads changed"
        _close(params, ref, f"rank {rank}: after the fixed step, param")


def test_bad_hyperparameter_names_the_base_optimizer(ranks):
    """With several base optimizers, 'param_groups[1]' alone is ambiguous (wrapper.param_groups
    flattens them: its [1] is optimizers[1].param_groups[0] here); the message should say which
    base optimizer (e.g. 'optimizers[1].param_groups[1]'). Its call site: _engine.py, collect()."""
    error = ranks(4).run(_rank_bad_hyper, 1, 1, "lr", float("nan"))[0][0]
    assert "optimizers[1]" in error, error


def _rank_adafactor(eps):
    from mfsdp_optim.optim import FullyShardedOptimizer

    specs = LAYOUTS["1d-uneven-empty"]
    params = _dparams(specs)
    opt = FullyShardedOptimizer(torch.optim.Adafactor(params, lr=0.01))
    opt.param_groups[0]["eps"] = eps  # after construction: the wrapper's check, not torch's
    _set_grads(params, specs, 0)
    try:
        ok = opt.step()[0]
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ok


def test_adafactor_eps_pair_is_accepted(ranks):
    assert ranks(4).run(_rank_adafactor, (None, 1e-3)) == [True] * 4
    assert ranks(4).run(_rank_adafactor, (1e-30, 1e-3)) == [True] * 4
    for error in ranks(4).run(_rank_adafactor, (None, "1e-3")):
        assert error.startswith("TypeError: param_groups[0]['eps'][1] is '1e-3' (str)"), error


# ---------------------------------------------------------------------------------------------
# lr schedulers and step(closure)


def _rank_schedulers(mode):
    params = _dparams(CHAIN)
    opt = _chain(params)
    StepLR, ExpLR = torch.optim.lr_scheduler.StepLR, torch.optim.lr_scheduler.ExponentialLR
    if mode == "wrapper":
        scheds = [StepLR(opt, step_size=1, gamma=0.5)]
    else:
        scheds = [StepLR(opt.optimizers[0], step_size=1, gamma=0.5), ExpLR(opt.optimizers[1], 0.8)]
    lrs, hooked = [], []
    for i, o in enumerate(opt.optimizers):
        o.register_step_post_hook(lambda *_, i=i: hooked.append(i))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _set_grads(params, CHAIN, step)
            assert opt.step()[0]
            opt.zero_grad()
            for sc in scheds:
                sc.step()
            lrs.append([g["lr"] for o in opt.optimizers for g in o.param_groups])
    notes = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return [p.full_tensor() for p in params], lrs, notes, hooked


def _both_halved(bases):
    return [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in bases]


def _each_own(bases):
    return [
        torch.optim.lr_scheduler.StepLR(bases[0], step_size=1, gamma=0.5),
        torch.optim.lr_scheduler.ExponentialLR(bases[1], 0.8),
    ]


@pytest.mark.parametrize("mode", ["wrapper", "each"])
def test_lr_schedulers_on_the_chain(ranks, mode):
    """StepLR on the wrapper reaches every group of both base optimizers; a scheduler on each
    base optimizer works as on the unsharded chain."""
    ref, ref_lrs = _chain_reference(STEPS, _both_halved if mode == "wrapper" else _each_own)
    for rank, (params, lrs, notes, _) in enumerate(ranks(4).run(_rank_schedulers, mode)):
        assert lrs == ref_lrs, (rank, lrs, ref_lrs)
        if mode == "wrapper":
            assert notes == [], (rank, notes)  # torch saw the wrapper's step before its own
        _close(params, ref, f"rank {rank}: param")
    if mode == "wrapper":  # halved each step, each group from its own initial lr
        assert ref_lrs[-1] == [v * 0.5**STEPS for v in (0.02, 0.01, 0.02)]


def test_base_optimizer_step_runs_for_muon(ranks):
    """Muon's own step() never runs under the wrapper (``_whole/_muon.py`` computes its update
    directly; the generic path calls step() on every rank): its step hooks do not fire, and a
    scheduler on it warns 'Detected call of `lr_scheduler.step()` before `optimizer.step()`'
    (the lrs are right). AdamW's fire once per step."""
    for _, _, notes, hooked in ranks(4).run(_rank_schedulers, "each"):
        assert notes == [], notes
        assert sorted(hooked) == [0] * STEPS + [1] * STEPS, hooked


def _rank_closure():
    params = _dparams(CHAIN)
    opt = _chain(params)
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        _set_grads(params, CHAIN, 0)
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()  # backward works inside it
        return x.grad.sum()

    with torch.no_grad():  # the closure gets grad enabled even so
        ok, norm, _ = opt.step(closure)
    return seen, ok, norm, [p.full_tensor() for p in params]


def test_step_closure_runs_once_with_grad_enabled(ranks):
    ref, _ = _chain_reference(1)
    want_norm = math.sqrt(
        sum(float(global_tensor(s, ()).double().pow(2).sum()) for s in _seeded(CHAIN, 100))
    )
    for seen, ok, norm, params in ranks(4).run(_rank_closure):
        assert seen == [True] and ok
        assert norm == pytest.approx(want_norm, rel=1e-6)  # the closure's grads were used
        _close(params, ref, "param")


# ---------------------------------------------------------------------------------------------
# several base optimizers: what is refused


def _rank_chain_errors():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from mfsdp_optim.optim import FullyShardedOptimizer

    params = _dparams(CHAIN)
    holder = torch.nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"w{i}", p)
    out = {}
    try:
        FullyShardedOptimizer(
            [torch.optim.SGD(params[:2], lr=0.1), torch.optim.AdamW(params[1:], lr=0.1)],
            model_chunks=[holder],
        )
    except ValueError as exc:
        out["overlap"] = str(exc)
    opt = _chain(params)
    for what, call in (
        ("optimizer", lambda: opt.optimizer),
        ("state_dict", opt.state_dict),
        ("add_param_group", lambda: opt.add_param_group({"params": [params[0]]})),
    ):
        try:
            call()
        except (AttributeError, NotImplementedError, TypeError) as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    out["groups"] = [len(o.param_groups) for o in opt.optimizers]
    # what the errors point to works: the stock helper over wrapper.optimizers, and stepping
    _set_grads(params, CHAIN, 0)
    out["stepped"] = opt.step()[0]
    osd = get_optimizer_state_dict(holder, opt.optimizers)
    out["stock_keys"] = sorted(osd["state"])
    return out


def test_chain_refusals_point_to_optimizers(ranks):
    for out in ranks(4).run(_rank_chain_errors):
        assert "param 'w1' is in optimizer[0] and optimizer[1]" in out["overlap"], out
        assert "disjoint" in out["overlap"]
        assert out["optimizer"].startswith("AttributeError: ") and (
            "wrapper.optimizers" in out["optimizer"]
        ), out
        assert out["state_dict"].startswith("NotImplementedError: "), out
        assert "get_optimizer_state_dict(model, wrapper.optimizers)" in out["state_dict"]
        assert "sharded_state_dict()" in out["state_dict"]
        assert out["add_param_group"].startswith("TypeError: ") and (
            "wrapper.optimizers" in out["add_param_group"]
        ), out
        assert out["groups"] == [1, 2]  # nothing was added
        assert out["stepped"] and out["stock_keys"] == ["w0", "w1", "w2", "w3"]


# ---------------------------------------------------------------------------------------------
# refusals at construction: subclasses of refused classes, declarations faster than known


class _MyLBFGS(torch.optim.LBFGS):
    pass


class _MySparseAdam(torch.optim.SparseAdam):
    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("cls", [_MyLBFGS, _MySparseAdam], ids=lambda c: c.__name__)
def test_subclasses_of_refused_classes_are_refused(cls):
    from mfsdp_optim.optim import FullyShardedOptimizer

    with pytest.raises(
        ValueError, match=rf"{cls.__name__} \(a (LBFGS|SparseAdam)\) cannot be wrapped"
    ):
        FullyShardedOptimizer(cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


@pytest.mark.parametrize(
    ("cls", "kind", "says"),
    [
        (torch.optim.LBFGS, "whole_param", r"torch.optim.LBFGS cannot be wrapped"),
        (torch.optim.SparseAdam, "elementwise", r"torch.optim.SparseAdam cannot be wrapped"),
        (torch.optim.Muon, "elementwise", r"Muon's update is 'whole_param'"),
        (torch.optim.Adafactor, "elementwise", r"Adafactor's update is 'whole_param'"),
        (_MyLBFGS, "elementwise", r"_MyLBFGS \(a LBFGS\) cannot be wrapped"),
    ],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_declarations_that_contradict_a_known_kind_are_refused(cls, kind, says):
    from mfsdp_optim.optim import OptimizerConfig

    with pytest.raises(
        ValueError, match=rf"update_kinds\[{cls.__name__}\] is '{kind}', but {says}"
    ):
        OptimizerConfig(update_kinds={cls: kind})


def test_safer_declarations_are_taken():
    """A declaration may be slower than what is known (Adam on whole params: exact), and a
    class declared cross_param is refused at construction, naming it."""
    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    config = OptimizerConfig(update_kinds={torch.optim.Adam: "whole_param", NormSGD: "cross_param"})
    assert config.update_kinds[torch.optim.Adam] == "whole_param"
    with pytest.raises(ValueError, match=r"NormSGD cannot be wrapped: its update reads across"):
        FullyShardedOptimizer(NormSGD([torch.nn.Parameter(torch.zeros(2))]), config)

    class Declared(NormSGD):
        mfsdp_update_kind = "cross_param"

    with pytest.raises(ValueError, match=r"Declared cannot be wrapped: its update reads across"):
        FullyShardedOptimizer(Declared([torch.nn.Parameter(torch.zeros(2))]))


# ---------------------------------------------------------------------------------------------
# the generic whole-param path carries any state a per-param class keeps


class StatefulSGD(torch.optim.Optimizer):
    """A per-param update whose state takes every form the generic path must carry: an
    optimizer-level counter ``state["k"]`` (as pytorch-optimizer's MADGRAD keeps), a value it
    writes into its group, a list and a dict holding param-shaped tensors, a scalar, a tensor
    replaced (not updated in place) every step, and a plain param-shaped tensor made at
    construction (as SPAM's masks). Reads the whole param (its norm), so it is not
    elementwise."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["mask"] = torch.ones(p.shape) > 0  # plain, param-shaped

    @torch.no_grad()
    def step(self, closure=None):
        if "k" not in self.state:
            self.state["k"] = torch.zeros((), dtype=torch.long)
        k = float(self.state["k"]) + 1
        for group in self.param_groups:
            group["t"] = group.get("t", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                    st["hist"] = [torch.zeros_like(p), 0]
                    st["more"] = {"m": torch.zeros_like(p), "n": (1.5, None)}
                st["buf"] = st["buf"] * 0.9 + p.grad  # replaced each step
                st["hist"][0].add_(p.grad.square())
                st["hist"][1] += 1
                st["more"]["m"].lerp_(p.grad, 0.5)
                norm = torch.linalg.vector_norm(st["buf"]).clamp(min=1e-12)
                upd = st["buf"] / norm + st["more"]["m"] * 1e-2 + st["hist"][0] * 1e-3
                upd = torch.where(st["mask"], upd, torch.zeros_like(upd))
                p.sub_(upd * group["lr"] * (k + group["t"] * 0.1 + st["hist"][1] * 0.01))
        self.state["k"].add_(1)


def _rank_stateful(specs, steps):
    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    params = _dparams(specs)
    opt = FullyShardedOptimizer(
        StatefulSGD(params, lr=LR), OptimizerConfig(update_kinds={StatefulSGD: "whole_param"})
    )
    for step in range(steps):
        _set_grads(params, specs, step)
        assert opt.step()[0]
        opt.zero_grad()
    base = opt.optimizers[0]
    return (
        [p.detach().full_tensor() for p in params],
        int(base.state["k"]),
        base.param_groups[0]["t"],
        [base.state[p]["hist"][1] for p in params],
    )


@pytest.mark.parametrize("layout", ["1d-uneven-empty", "hsdp-2x2", "2d-shard-shard"])
def test_generic_path_carries_every_kind_of_state(ranks, layout):
    specs = LAYOUTS[layout]
    steps = 4
    ref = [torch.nn.Parameter(global_tensor(s, ()).clone()) for s in _seeded(specs, 1)]
    ref_opt = StatefulSGD(ref, lr=LR)
    for step in range(steps):
        for p, s in zip(ref, _seeded(specs, 100 + step), strict=True):
            p.grad = global_tensor(s, ()).clone()
        ref_opt.step()
    for rank, (params, k, t, counts) in enumerate(ranks(4).run(_rank_stateful, specs, steps)):
        assert (k, t) == (steps, steps), (rank, k, t)
        assert counts == [steps] * len(specs), (rank, counts)
        for i, (got, want) in enumerate(zip(params, ref, strict=True)):
            assert torch.equal(got, want.detach()), f"rank {rank}, param {i}: params differ"


# ---------------------------------------------------------------------------------------------
# Adafactor over a group mixing bf16 and fp32 params: eps1 as stock torch picks it
# (foreach=False: the group's first param's dtype; foreach=True: the first of torch's
# (device, dtype) buckets, whose order is its C++ grouping's, not the params')

MIXED_DTYPES = [
    ["bfloat16", "float32", "float32"],
    ["float32", "bfloat16", "float32"],
    ["float32", "float32", "bfloat16"],
]


def _rank_adafactor_mixed(specs, dtypes, steps, foreach):
    from mfsdp_optim.optim import FullyShardedOptimizer

    params = [
        torch.nn.Parameter(p.to(getattr(torch, dt)))
        for p, dt in zip(_dparams(specs), dtypes, strict=True)
    ]
    opt = FullyShardedOptimizer(torch.optim.Adafactor(params, lr=0.01, foreach=foreach))
    for step in range(steps):
        from _layouts import build_grad

        for p, s in zip(params, _seeded(specs, 100 + step), strict=True):
            g = build_grad(s, check=False)
            g._local_tensor.mul_(1e-3)
            p.grad = g.to(p.dtype)
        assert opt.step()[0]
        opt.zero_grad()
    return [p.detach().full_tensor() for p in params]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("dtypes", MIXED_DTYPES, ids=["-".join(d) for d in MIXED_DTYPES])
def test_adafactor_mixed_dtypes_take_eps1_as_torch_does(ranks, dtypes, foreach):
    """Stock torch takes eps1 (when ``eps=(None, ...)``) from one dtype for the whole group;
    an owner of a param of another dtype alone must use that eps too (0.025-0.054 off before,
    and about three updates off with ``foreach=True``). Compared bit for bit with the stock
    class stepping the unsharded params with the same options."""
    specs = LAYOUTS["1d-uneven-empty"]
    steps = 3
    ref = [
        torch.nn.Parameter(global_tensor(s, ()).clone().to(getattr(torch, dt)))
        for s, dt in zip(_seeded(specs, 1), dtypes, strict=True)
    ]
    ref_opt = torch.optim.Adafactor(ref, lr=0.01, foreach=foreach)
    for step in range(steps):
        for p, s in zip(ref, _seeded(specs, 100 + step), strict=True):
            p.grad = (global_tensor(s, ()) * 1e-3).to(p.dtype)
        ref_opt.step()
    run = ranks(4).run(_rank_adafactor_mixed, specs, dtypes, steps, foreach)
    for rank, params in enumerate(run):
        for i, (got, want) in enumerate(zip(params, ref, strict=True)):
            assert torch.equal(got, want.detach()), f"rank {rank}, param {i}: params differ"
