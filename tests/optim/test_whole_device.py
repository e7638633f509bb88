"""The whole-param step under ``OptimizerConfig(host_sync=False)`` (optim/_whole, ``_verdict``).

Muon keeps its verdict on the device: a steady step (its plan built at an earlier step) reads
nothing on the host, counted with the TorchFunctionMode of ``test_host_sync`` (``item``,
``tolist``, ``__bool__`` ...), and steps bit for bit what stock torch's Muon steps on the
unsharded params, on the layouts of ``test_whole_param``. The generic path (Adafactor, an unknown
class) sends its host values through a host-side group and must step the same bits too.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import get_pool  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_host_sync import CountHostReads  # noqa: E402
from test_reliability_whole import REPLICA_CASES  # noqa: E402
from test_whole_param import (  # noqa: E402
    LAYOUTS,
    OPTIMIZERS,
    _assert_like_reference,
    _cases,
    _grad_spec,
    _param_spec,
)

pytestmark = pytest.mark.timeout(300)


def _rank_train_on_device(specs, opt_name, steps=3, break_it=False):
    """``step_whole_params`` with a ``DeviceVerdict`` at every step, next to the class on this
    rank's stripe of the unsharded params: (host reads per step, verdict per step)."""
    import torch.distributed as dist
    from _layouts import build_grad, global_tensor, stripe_of

    from mfsdp_optim.optim._whole import DeviceVerdict, step_whole_params

    cls, kw = OPTIMIZERS[opt_name]
    rank = dist.get_rank()
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    ref = [torch.nn.Parameter(global_tensor(_param_spec(s), stripe_of(rank, s))) for s in specs]
    ref_opt = cls(ref, **kw)
    plan, reads, bads = None, [], []
    for step in range(steps):
        for p, r, s in zip(params, ref, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
            r.grad = global_tensor(_grad_spec(s, step), stripe_of(rank, s)).to(p.dtype)
        verdict = DeviceVerdict(torch.device("cpu"))
        counter = CountHostReads()
        with counter:
            plan = step_whole_params(opt, params, plan_cache=plan, verdict=verdict)
        reads.append(len(counter.reads))
        bads.append(bool(verdict.bad))
        ref_opt.step()
    if break_it:
        params[0]._local_tensor.view(-1)[:1].add_(1e-3)
    _assert_like_reference(opt, ref_opt, params, ref, specs)
    return reads, bads


@pytest.mark.parametrize("opt_name", ["Muon", "MuonPlain", "Adafactor", "NormalizedSGD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bit_for_bit_vs_unsharded_without_host_sync(layout, opt_name):
    world, specs = LAYOUTS[layout]
    for reads, bads in get_pool(world).run(_rank_train_on_device, specs, opt_name):
        assert bads == [False] * 3, bads
        if opt_name.startswith("Muon"):  # the first step builds the plan (reads the host)
            assert reads[1:] == [0, 0], reads


def test_a_broken_update_is_noticed_without_host_sync():
    with pytest.raises(AssertionError, match="param 0"):
        get_pool(2).run(
            _rank_train_on_device, LAYOUTS["1d-uneven-empty-2"][1], "Muon", break_it=True
        )


# ---------------------------------------------------------------------------------------------
# faults on some ranks (the failing rank kept alive): Muon refuses on the device, the generic
# path raises on every rank through its host-side group; nothing changes anywhere, no hang


def _rank_fault_on_device(opt_name, layout, fault, bad, fault_step):
    """``test_reliability_whole``'s faulty step under a ``DeviceVerdict``: clean steps, the
    faulty one, a clean one after it. Returns the faulty step's ``[outcome, message, seconds,
    verdict (None where it raised), what changed if refused]`` and the clean steps' verdicts."""
    from _layouts import build_grad
    from test_reliability_whole import _inject, _snapshot, _unchanged

    from mfsdp_optim._infra.agreement import RankFailedError
    from mfsdp_optim.optim._whole import DeviceVerdict, step_whole_params

    _, specs = LAYOUTS[layout]
    cls, kw = OPTIMIZERS[opt_name]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan, outcome, clean = None, None, []
    for step in range(fault_step + 2):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
        verdict = DeviceVerdict(torch.device("cpu"))
        if step != fault_step:
            plan = step_whole_params(opt, params, plan_cache=plan, verdict=verdict)
            clean.append(bool(verdict.bad))
            continue
        before = _snapshot(opt, params)
        undo = _inject(fault, opt_name, opt, params, bad)
        t0 = time.monotonic()
        try:
            plan = step_whole_params(opt, params, plan_cache=plan, verdict=verdict)
            outcome = ["ok", "", time.monotonic() - t0, bool(verdict.bad)]
        except Exception as exc:
            name = "RankFailedError" if isinstance(exc, RankFailedError) else type(exc).__name__
            outcome = [name, str(exc), time.monotonic() - t0, None]
            plan = verdict.plan or plan  # the plan the step ran with, as its peers keep it
        finally:
            undo()
        refused = outcome[0] != "ok" or outcome[3]
        outcome.append(_unchanged(before, _snapshot(opt, params)) if refused else [])
        if step == 0 and outcome[0] == "ok" and opt_name.startswith("Muon"):
            # a first step refused on the device leaves zero momentum buffers (its start)
            zero = all(not s["momentum_buffer"]._local_tensor.any() for s in opt.state.values())
            outcome[4] = [d for d in outcome[4] if not d.startswith("state entries")]
            outcome[4] += [] if zero else ["a momentum buffer that is not zeros"]
    return outcome, clean


def _check_on_device(out, fault, bad, world):
    """Muon at a steady step: the failing ranks raise their own error, every other rank returns
    with the verdict set; nothing changed anywhere; the next step is clean everywhere."""
    from test_reliability_whole import DEADLINE_S

    outcomes = [o for o, _ in out]
    assert all(c == [False] * len(c) for _, c in out), out  # the clean steps, before and after
    raised = {r for r, o in enumerate(outcomes) if o[0] != "ok"}
    refused = bool(raised) or any(o[3] for o in outcomes)
    if fault == "grad_none" and len(bad) == world:  # no grad anywhere: skipped, as stock does
        assert not refused, outcomes
        return
    if fault in ("grad_layout", "grad_shape", "hyper", "state"):  # each faulty rank finds it
        assert raised == set(bad), (raised, bad, outcomes)
    elif fault == "compute":  # the faulty ranks that own a matrix
        assert raised <= set(bad), (raised, bad, outcomes)
    else:  # a grad None on some holders only: found by the owners, on the device
        assert not raised, outcomes
    if fault != "compute" or raised:
        assert refused, outcomes
    for r, (name, message, seconds, verdict, diffs) in enumerate(outcomes):
        assert seconds < DEADLINE_S, (r, seconds)
        assert not diffs, f"rank {r} changed {diffs} on a refused step"
        if r not in raised:
            assert name == "ok" and verdict == refused, (r, outcomes)
        else:
            assert name not in ("ok", "RankFailedError"), (r, name, message)


DEVICE_CASES = [  # Muon: a fault before the agreement, in the pre-work before the first
    # exchange, at the owner between the exchanges; one and several failing ranks; at a steady
    # step, and after the agreement of the step that builds the plan (step 0)
    ("Muon", "dense-plus-experts", "grad_layout", (1,), 1),
    ("Muon", "hsdp-2x2", "grad_shape", (2,), 1),
    ("Muon", "dense-plus-experts", "hyper", (0, 3), 1),
    ("MuonPlain", "2d-shard-shard", "hyper", (1,), 1),
    ("Muon", "2d-shard-shard", "state", (3,), 1),
    ("Muon", "dense-plus-experts", "grad_none", (1,), 1),
    ("Muon", "strided", "grad_none", (0, 1, 2, 3), 1),
    ("Muon", "1d-uneven-empty-4", "compute", (0, 1, 2, 3), 1),
    ("Muon", "hsdp-2x2", "compute", (1,), 1),
    ("Muon", "hsdp-2x2", "compute", (0, 1, 2, 3), 0),
    ("Muon", "dense-plus-experts", "grad_none", (2,), 0),
]


@pytest.mark.parametrize("case", DEVICE_CASES, ids=["-".join(map(str, c)) for c in DEVICE_CASES])
def test_muon_fault_refused_on_the_device_nothing_changed(case):
    from test_reliability_whole import RUN_S

    opt_name, layout, fault, bad, fault_step = case
    world = LAYOUTS[layout][0]
    out = get_pool(world).run(
        _rank_fault_on_device, opt_name, layout, fault, bad, fault_step, timeout=RUN_S
    )
    _check_on_device(out, fault, bad, world)
    if fault == "compute" and len(bad) == world:  # some rank owns a matrix: it must bite
        assert any(o[0] != "ok" for o, _ in out), out


HOSTED_CASES = [  # the generic path; Muon before the agreement of the step that builds its
    # plan: every rank raises
    ("Adafactor", "dense-plus-experts", "hyper", (2,), 1),
    ("Adafactor", "hsdp-2x2", "grad_none", (0,), 1),
    ("Adafactor", "strided", "compute", (1,), 1),
    ("NormalizedSGD", "dense-plus-experts", "compute", (3,), 0),
    ("NormalizedSGD", "2d-shard-shard", "state", (1, 2), 1),
    ("Muon", "dense-plus-experts", "grad_layout", (1,), 0),  # before the plan's agreement
    ("Muon", "hsdp-2x2", "hyper", (0, 1, 2, 3), 0),
]


@pytest.mark.parametrize("case", HOSTED_CASES, ids=["-".join(map(str, c)) for c in HOSTED_CASES])
def test_hosted_fault_refused_on_every_rank(case):
    from test_reliability_whole import RUN_S, _check

    opt_name, layout, fault, bad, fault_step = case
    world = LAYOUTS[layout][0]
    out = get_pool(world).run(
        _rank_fault_on_device, opt_name, layout, fault, bad, fault_step, timeout=RUN_S
    )
    assert all(c == [False] * len(c) for _, c in out), out
    _check([o[:3] + o[4:] for o, _ in out], opt_name, fault, bad)


HOSTED_REPLICA_CASES = [  # test_reliability_whole's replica faults on the hosted path (its
    # packing faults patch the device path's packer: here a header that does not pickle)
    c
    for c in REPLICA_CASES
    if c[2] not in ("pack_in", "pack_out")
]


@pytest.mark.parametrize(
    "case",
    HOSTED_REPLICA_CASES,
    ids=["-".join([c[0], c[1], c[2], "+".join(c[3])]) for c in HOSTED_REPLICA_CASES],
)
def test_hosted_replica_fault_refused_on_every_rank(case):
    """A receiver, the owner or a member of a unit over the replicas fails (before the
    agreement, before the first exchange, at the owner between the exchanges, a group value
    that does not pickle during the second): every rank raises, nothing changed."""
    from test_reliability_whole import RUN_S, _check_replica, _rank_replica_fault

    opt_name, layout, fault, roles = case
    out = get_pool(4).run(_rank_replica_fault, opt_name, layout, fault, roles, True, timeout=RUN_S)
    _check_replica(out, fault)


# ---------------------------------------------------------------------------------------------
# through the wrapper: Muon + fused AdamW, host_sync=True and False side by side


INF_STEPS = {2, 3}


def _pair(params_of, host_sync, scaler=True):
    from test_reliability_whole import _holder

    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig

    params = params_of()
    muon = torch.optim.Muon(params[:3], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW(params[3:], lr=0.01, weight_decay=0.1, fused=True)
    return params, FullyShardedOptimizer(
        [muon, adamw],
        OptimizerConfig(clip_grad=0.5, log_num_zeros_in_grad=True, host_sync=host_sync),
        grad_scaler=DynamicGradScaler(
            2.0**10, growth_factor=1.5, backoff_factor=0.3, growth_interval=2, hysteresis=1
        )
        if scaler
        else None,
        model_chunks=[_holder(params)],
    )


def _set_grads(opt, params, specs, step, inf_rank=None, in_place=False):
    """Each param's grad of ``step`` (times the loss scale), an inf planted where ``inf_rank``;
    ``in_place``: written into the grads of the last step (what FSDP2 does after
    ``zero_grad(set_to_none=False)``)."""
    from _layouts import build_grad
    from torch.distributed.tensor import DTensor

    for p, s in zip(params, specs, strict=True):
        g = build_grad(_grad_spec(s, step), check=False)
        local = g._local_tensor * (opt.grad_scaler.scale_on("cpu") if opt.grad_scaler else 1)
        if inf_rank is not None and local.numel():
            local.view(-1)[0] = float("inf")
        if in_place and p.grad is not None:
            p.grad._local_tensor.copy_(local)
            continue
        p.grad = DTensor.from_local(
            local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
        )


def _rank_wrapper_pair(scaler, inf_steps=INF_STEPS):
    import torch.distributed as dist
    from test_reliability_whole import _chain_params

    specs, _ = _chain_params()
    pairs = [_pair(lambda: _chain_params()[1], h, scaler) for h in (True, False)]
    reads, oks = [], []
    for step in range(6):
        inf = dist.get_rank() == 1 and step in inf_steps and scaler
        for params, opt in pairs:
            _set_grads(opt, params, specs, step, 1 if inf else None)
        host = pairs[0][1].step()
        counter = CountHostReads()
        with counter:
            dev = pairs[1][1].step()
        reads.append(len(counter.reads))
        assert isinstance(dev[0], torch.Tensor) and isinstance(dev[1], torch.Tensor)
        assert bool(dev[0]) == host[0] and int(dev[2]) == host[2], (step, dev, host)
        assert float(dev[1]) == host[1] or (host[1] != host[1] and float(dev[1]) != float(dev[1]))
        oks.append(host[0])
        (pa, oa), (pb, ob) = pairs
        for a, b in zip(pa, pb, strict=True):
            assert torch.equal(a._local_tensor, b._local_tensor), step
        for base_a, base_b in zip(oa.optimizers, ob.optimizers, strict=True):
            mine, theirs = base_a.param_groups[0]["params"], base_b.param_groups[0]["params"]
            for a, b in zip(mine, theirs, strict=True):
                sa, sb = base_a.state.get(a, {}), base_b.state.get(b, {})
                if not sa and sb:  # a skipped first step: the state made up front, zeros
                    assert not any(getattr(v, "_local_tensor", v).any() for v in sb.values())
                    continue
                assert set(sa) == set(sb), (step, set(sa), set(sb))
                for k in sa:
                    va, vb = sa[k], sb[k]
                    va = getattr(va, "_local_tensor", va)
                    vb = getattr(vb, "_local_tensor", vb)
                    assert torch.equal(va, vb), (step, k)
        if scaler:
            assert oa.grad_scaler.state_dict() == ob.grad_scaler.state_dict(), step
        for _, opt in pairs:
            opt.zero_grad()
    return reads, oks


@pytest.mark.parametrize(
    "scaler, inf_steps", [(True, INF_STEPS), (True, {0, 4}), (False, set())], ids=str
)
def test_muon_and_adamw_without_host_sync_same_trajectory_no_host_read(scaler, inf_steps):
    """Skips on the device at steady steps and at the step that builds Muon's plan (a skipped
    first step leaves zero momentum buffers where stock leaves none)."""
    for reads, oks in get_pool(4).run(_rank_wrapper_pair, scaler, inf_steps):
        assert oks == [s not in inf_steps for s in range(6)], oks
        assert reads[1:] == [0] * 5, reads  # the first step builds Muon's plan


def _rank_wrapper_fault(fault, bad):
    """Muon + fused AdamW under host_sync=False, a fault on ``bad`` at step 2: (per step:
    outcome, ok, norm is NaN, what changed on a refused step)."""
    import torch.distributed as dist
    from test_reliability_whole import _chain_params, _snapshot, _unchanged

    import mfsdp_optim.optim._whole._muon as muon_module

    specs, _ = _chain_params()
    params, opt = _pair(lambda: _chain_params()[1], False, scaler=False)
    out = []
    for step in range(5):
        _set_grads(opt, params, specs, step)
        before = [_snapshot(o, o.param_groups[0]["params"]) for o in opt.optimizers]
        undo = lambda: None  # noqa: E731
        if step == 2 and dist.get_rank() in bad:
            if fault == "hyper":
                group = opt.optimizers[0].param_groups[0]
                group["ns_steps"] = 100
                undo = functools.partial(group.__setitem__, "ns_steps", 5)
            elif fault == "compute":
                real = muon_module._zeropower_via_newtonschulz

                def broken(*args, **kwargs):
                    raise RuntimeError("Newton-Schulz failed on purpose")

                muon_module._zeropower_via_newtonschulz = broken
                undo = functools.partial(setattr, muon_module, "_zeropower_via_newtonschulz", real)
        if step == 3 and fault == "invalidate" and dist.get_rank() in bad:
            opt.invalidate_caches()  # on some ranks only: refused until every rank does
        if step == 4 and fault == "invalidate":
            opt.invalidate_caches()
        t0 = time.monotonic()
        try:
            ok, norm, _ = opt.step()
            row = ["ok", bool(ok), bool(norm.isnan())]
        except Exception as exc:
            row = [type(exc).__name__ + ": " + str(exc), None, None]
        finally:
            undo()
        row.append(time.monotonic() - t0)
        after = [_snapshot(o, o.param_groups[0]["params"]) for o in opt.optimizers]
        changed = [d for b, a in zip(before, after, strict=True) for d in _unchanged(b, a)]
        row.append(changed if row[1] is not True else [])
        out.append(row)
        opt.zero_grad()
    return out


@pytest.mark.parametrize(
    "fault, bad", [("hyper", (1,)), ("compute", (0, 1, 2, 3)), ("invalidate", (2,))]
)
def test_muon_fault_through_the_wrapper_refuses_every_update(fault, bad):
    from test_reliability_whole import DEADLINE_S, RUN_S

    out = get_pool(4).run(_rank_wrapper_fault, fault, bad, timeout=RUN_S)
    refused_at = {"hyper": {2}, "compute": {2}, "invalidate": {3}}[fault]
    for r, rows in enumerate(out):
        for step, (outcome, ok, nan, seconds, changed) in enumerate(rows):
            assert seconds < DEADLINE_S, (r, step, seconds)
            if step not in refused_at:
                assert outcome == "ok" and ok and not nan, (r, step, rows[step])
                continue
            assert not changed, (r, step, changed)  # neither Muon nor the AdamW after it
            if outcome == "ok":
                assert ok is False and nan, (r, step, rows[step])
            elif fault == "hyper":
                assert r in bad and "ns_steps" in outcome, (r, outcome)
            elif fault == "invalidate":
                assert r in bad and "RankMismatchError" in outcome, (r, outcome)
                assert "invalidate_caches() on every rank" in outcome, outcome
    raised = [r for r, rows in enumerate(out) for s in refused_at if rows[s][0] != "ok"]
    if fault in ("hyper", "invalidate"):
        assert sorted(raised) == list(bad), out
    else:
        assert raised, out  # the owners raise, the other ranks are refused on the device


# ---------------------------------------------------------------------------------------------
# the captured step's decisions with Muon (CapturedStep with an EagerRunner, on CPU ranks)


def _rank_captured_muon(muon_lr_change_at):
    """Muon + fused AdamW: one wrapper through CapturedStep(EagerRunner), one plain
    host_sync=False wrapper, the same grads; AdamW's lr changes every step, Muon's once at
    ``muon_lr_change_at``, an inf on rank 1 at step 4. Returns (after each step: captures so
    far or "eager", replays, disabled reason)."""
    import torch.distributed as dist
    from test_reliability_whole import _chain_params

    from mfsdp_optim import OptimizerConfig
    from mfsdp_optim.optim._captured._graph import EagerRunner

    specs, _ = _chain_params()
    (pc, wc), (pe, we) = [_pair(lambda: _chain_params()[1], False, scaler=True) for _ in "ce"]
    wc.config = OptimizerConfig(
        clip_grad=0.5, log_num_zeros_in_grad=True, host_sync=False, cuda_graph=True
    )
    wc._captured = wc._captured_step(runner=EagerRunner())
    history = []
    for step in range(8):
        for params, w in ((pc, wc), (pe, we)):
            inf = 1 if step == 4 and dist.get_rank() == 1 else None  # skipped on the device
            _set_grads(w, params, specs, step, inf, in_place=True)
            w.optimizers[1].param_groups[0]["lr"] = 2.0**-7 * (1 + step % 3)  # float32-exact
            if step == muon_lr_change_at:
                w.optimizers[0].param_groups[0]["lr"] = 0.03
        rc, re_ = wc.step(), we.step()
        assert bool(rc[0]) == bool(re_[0]) == (step != 4), step
        assert torch.equal(rc[1], re_[1]) or (rc[1].isnan() and re_[1].isnan()), step
        for a, b in zip(pc, pe, strict=True):
            assert torch.equal(a._local_tensor, b._local_tensor), step
        for oa, ob in zip(wc.optimizers, we.optimizers, strict=True):
            for a, b in zip(
                oa.param_groups[0]["params"], ob.param_groups[0]["params"], strict=True
            ):
                for k, v in oa.state[a].items():
                    w_ = ob.state[b][k]
                    assert torch.equal(
                        getattr(v, "_local_tensor", v), getattr(w_, "_local_tensor", w_)
                    )
        graph = wc._captured.graph
        history.append("eager" if graph.disabled else graph.captures)
        for w in (wc, we):
            w.zero_grad(set_to_none=False)
    return history, graph.replays, graph.disabled


def test_captured_step_takes_muon_and_adamw():
    for history, replays, disabled in get_pool(4).run(_rank_captured_muon, None):
        # step 0 builds Muon's plan (blocked once), step 1 warms up and captures, then replays
        assert history == [0, 1, 1, 1, 1, 1, 1, 1] and replays == 6 and disabled is None, (
            history,
            replays,
            disabled,
        )


def test_a_muon_lr_change_captures_again():
    for history, replays, disabled in get_pool(4).run(_rank_captured_muon, 5):
        assert history == [0, 1, 1, 1, 1, 2, 2, 2] and replays == 2 and disabled is None, (
            history,
            replays,
            disabled,
        )


# ---------------------------------------------------------------------------------------------
# hypothesis: drawn layouts and shapes (test_whole_param's strategy), drawn faults


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_hypothesis_shapes_and_layouts_without_host_sync(case):
    world, opt_name, specs = case
    for reads, bads in get_pool(world).run(_rank_train_on_device, specs, opt_name, steps=2):
        assert bads == [False, False], bads
        if opt_name == "Muon":
            assert reads[1:] == [0], reads


@st.composite
def _device_faults(draw):
    opt_name = draw(st.sampled_from(["Muon", "MuonPlain"]))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    world = LAYOUTS[layout][0]
    fault = draw(st.sampled_from(["grad_layout", "grad_shape", "hyper", "state", "grad_none"]))
    fault = draw(st.sampled_from([fault, "compute"]))
    bad = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
    return opt_name, layout, fault, bad


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(_device_faults())
def test_hypothesis_muon_faults_on_the_device(case):
    from test_reliability_whole import RUN_S

    opt_name, layout, fault, bad = case
    world = LAYOUTS[layout][0]
    out = get_pool(world).run(_rank_fault_on_device, opt_name, layout, fault, bad, 1, timeout=RUN_S)
    _check_on_device(out, fault, bad, world)
