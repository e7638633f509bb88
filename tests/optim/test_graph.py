"""The captured step's bookkeeping (``OptimizerConfig(cuda_graph=True)``), on CPU.

``optim._captured._graph`` is pure bookkeeping: what a capture depends on (``Inputs``), the per-step
scalars in device memory (``ScalarSlots``), the host counters a replay bumps (``Counters``) and
the decision at each step (``StepGraph.plan``). The wrapper's glue (``optim._captured._step``) runs
here with ``EagerRunner``, which runs the "captured" body again at every replay: the same
decisions (capture, replay, re-capture after a moved grad, eager with one warning) and the lr
slots the update reads, checked against a plain eager wrapper fed the same grads, bit for bit.
The real CUDA graph: ``tests/optim/test_cuda_graph.py`` (GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mfsdp_optim import OptimizerConfig
from mfsdp_optim.optim._captured._graph import (
    MIN_REPLAYS,
    Counters,
    EagerRunner,
    Inputs,
    ScalarSlots,
    StepGraph,
)

# ------------------------------------------------------------------------------- _graph alone


def test_inputs_compare_objects_by_identity_and_values_by_equality():
    a, b = torch.zeros(2), torch.zeros(2)
    base = Inputs([a, b], (1.0, "x"))
    assert base.same(Inputs([a, b], (1.0, "x")))
    assert not base.same(Inputs([a, torch.zeros(2)], (1.0, "x")))  # equal values, new object
    assert not base.same(Inputs([a, b], (2.0, "x")))
    assert not base.same(Inputs([a], (1.0, "x")))
    long = Inputs([a], (), [[a, b]])
    assert long.same(Inputs([a], (), [[a, b]])) and long.same_head(Inputs([a], ()))
    assert not long.same(Inputs([a], (), [[a, torch.zeros(2)]]))
    assert not long.same(Inputs([a], (), [[a]]))


def test_scalar_slots_upload_only_what_changed():
    slots = ScalarSlots([0.5, 0.25], torch.device("cpu"), torch.float32)
    view = slots.slot(1)
    assert slots.uploads == 1 and slots.tensor.tolist() == [0.5, 0.25]
    assert not slots.update([0.5, 0.25])
    assert slots.uploads == 1
    assert slots.update([0.5, 0.125])
    assert slots.uploads == 2 and float(view) == 0.125 and slots.slot(1) is view
    with pytest.raises(ValueError, match="holds 2 values"):
        slots.update([1.0])


def test_counters_undo_a_capture_and_add_its_bumps_per_replay():
    class Box:
        n = 3
        m = 7

    box = Box()
    c = Counters([(box, "n"), (box, "m")])
    c.begin()
    box.n += 1  # what the captured body did
    c.end()
    assert (box.n, box.m) == (3, 7)  # undone
    c.replayed()
    c.replayed()
    assert (box.n, box.m) == (5, 7)


def test_step_graph_decisions():
    runner = EagerRunner()
    g = StepGraph(runner)
    a = object()
    now = {"inputs": Inputs([a], (1,))}

    def current():
        return now["inputs"]

    def still_valid(captured):
        return captured.same(current())

    assert g.plan(still_valid) == "capture"
    runner.capture(lambda: "ran")
    g.captured_with(current(), keep=[])
    for _ in range(MIN_REPLAYS):
        assert g.plan(still_valid) == "replay"
        assert g.replay() == "ran"
    now["inputs"] = Inputs([object()], (1,))  # a grad moved, after enough replays
    assert g.plan(still_valid) == "capture" and not g.captured
    g.captured_with(current(), keep=[])
    now["inputs"] = Inputs([object()], (1,))  # moved again before MIN_REPLAYS replays
    with pytest.warns(RuntimeWarning, match="inputs changed after 0 replay"):
        assert g.plan(still_valid) == "eager"
    assert g.plan(still_valid) == "eager" and g.disabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g.disable("again")  # one warning only
    g = StepGraph(EagerRunner())
    g.blocked("not now")  # the first blocked attempt: the next step tries again
    assert g.disabled is None and g.plan(still_valid) == "capture"
    g.captured_with(current(), keep=[])
    g.drop()
    g.blocked("not now")  # a capture in between: again one more try
    assert g.disabled is None
    with pytest.warns(RuntimeWarning, match="not now"):
        g.blocked("not now")
    assert g.plan(still_valid) == "eager"


def test_config_needs_host_sync_false_and_is_keyword_only():
    with pytest.raises(ValueError, match="needs host_sync=False"):
        OptimizerConfig(cuda_graph=True)
    assert OptimizerConfig(cuda_graph=True, host_sync=False).cuda_graph
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        OptimizerConfig(cuda_graph=1, host_sync=False)


# ----------------------------------------------------------------------- the wrapper's glue

SHAPES = [(6, 4), (5,), (3, 3)]
LR = 2.0**-6  # float32-exact: the lr slots hold float32, as torch's fused kernel reads them


def _dparams(init, mesh):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for full in init:
        local = torch.chunk(full, world)[rank] if full.shape[0] >= world else full[:0]
        dt = DTensor.from_local(
            local.clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        out.append(torch.nn.Parameter(dt))
    return out


def _set_grads(params, fulls, mesh, in_place):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    for p, g in zip(params, fulls, strict=True):
        local = torch.chunk(g, world)[rank] if g.shape[0] >= world else g[:0]
        if in_place and p.grad is not None:
            p.grad._local_tensor.copy_(local)
        else:
            p.grad = DTensor.from_local(
                local.clone(), mesh, [Shard(0)], run_check=False, shape=g.shape, stride=g.stride()
            )


def _pair(base_cls, base_kw, scaler_cls=None, split=False):
    """A wrapper whose step runs through CapturedStep with an EagerRunner, and a plain
    host_sync=False wrapper over identical params (``split``: two base optimizers, the first
    param in one, the others in the second)."""
    import torch.distributed as dist
    from _layouts import get_mesh

    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer

    mesh = get_mesh((dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    out = []
    for captured in (True, False):
        ps = _dparams(init, mesh)
        scaler = None
        if scaler_cls is DynamicGradScaler:
            scaler = DynamicGradScaler(2.0**8, growth_interval=2, hysteresis=1)
        base = [base_cls(ps[:1], **base_kw), base_cls(ps[1:], **base_kw)] if split else None
        model = torch.nn.Module()  # names the params of two base optimizers apart
        for i, p in enumerate(ps):
            model.register_parameter(f"p{i}", p)
        w = FullyShardedOptimizer(
            base or base_cls(ps, **base_kw),
            OptimizerConfig(clip_grad=0.5, host_sync=False),
            grad_scaler=scaler,
            model_chunks=[model] if split else (),
        )
        if captured:
            w.config = OptimizerConfig(clip_grad=0.5, host_sync=False, cuda_graph=True)
            w._captured = w._captured_step(runner=EagerRunner())
        out.append((w, ps))
    return mesh, out


def _same(a, b):
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    for (wa, pa), (wb, pb) in [(a, b)]:
        for x, y in zip(pa, pb, strict=True):
            if not torch.equal(local(x), local(y)):
                return False
            sa, sb = wa.state.get(x, {}), wb.state.get(y, {})
            if set(sa) != set(sb) or not all(torch.equal(local(sa[k]), local(sb[k])) for k in sa):
                return False
    return True


def _rank_trajectory(
    move_at: int | None, set_to_none: bool, scaler: bool, move_param: bool = False
):
    """Ten steps of both wrappers on the same grads, an lr schedule halving the lr every other
    step, an inf planted at step 4 (with a scaler): the captured one must match bit for bit."""
    from mfsdp_optim import DynamicGradScaler

    mesh, [(wc, pc), (we, pe)] = _pair(
        torch.optim.AdamW,
        dict(lr=LR, weight_decay=0.1, fused=True),
        DynamicGradScaler if scaler else None,
    )
    scheds = [torch.optim.lr_scheduler.StepLR(w, step_size=2, gamma=0.5) for w in (wc, we)]
    oks, norms, history = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            gen = torch.Generator().manual_seed(100 + step)
            fulls = [torch.randn(s, generator=gen) for s in SHAPES]
            if scaler and step == 4:
                fulls[0].view(-1)[0] = float("inf")
            for ps in (pc, pe):
                moved = step == move_at
                if moved and move_param:  # a param's local tensor replaced (same values)
                    ps[0]._local_tensor = ps[0]._local_tensor.clone()
                _set_grads(
                    ps, fulls, mesh, in_place=not set_to_none and not (moved and not move_param)
                )
            rc, re_ = wc.step(), we.step()
            assert torch.equal(rc[1], re_[1]) or (rc[1].isnan() and re_[1].isnan()), step
            assert bool(rc[0]) == bool(re_[0]), step
            assert _same((wc, pc), (we, pe)), step
            oks.append(bool(rc[0]))
            norms.append(float(rc[1]))
            graph = wc._captured.graph
            history.append("eager" if graph.disabled else graph.captures)
            for w, s in zip((wc, we), scheds, strict=True):
                w.zero_grad(set_to_none=set_to_none)
                s.step()
    cs = wc._captured
    return {
        "oks": oks,
        "history": history,  # after each step: captures so far, or "eager"
        "captures": cs.graph.captures,
        "disabled": cs.graph.disabled,
        "warnings": [str(w.message) for w in caught if "cuda_graph" in str(w.message)],
        "fast_steps": (wc.fast_steps, we.fast_steps),
        "lr_uploads": wc._engines[0].fast.lr_slots.uploads,
        "lr": wc.param_groups[0]["lr"],
    }


@pytest.mark.parametrize("scaler", [False, True], ids=["no-scaler", "dynamic-scaler"])
def test_captured_glue_matches_eager(ranks, scaler):
    for out in ranks(2).run(_rank_trajectory, None, False, scaler):
        assert out["captures"] == 1 and out["disabled"] is None, out
        assert not out["warnings"], out
        assert out["fast_steps"] == (10, 10), out
        # steps 2, 4, 6 and 8 ran with a new lr: the first upload, then one per change (the
        # scheduler halved it once more after the last step)
        assert out["lr_uploads"] == 5 and out["lr"] == LR / 32, out
        if scaler:
            assert out["oks"] == [s != 4 for s in range(10)], out["oks"]


def test_moved_grad_is_captured_again(ranks):
    for out in ranks(2).run(_rank_trajectory, 5, False, True):
        # captured at the first step, again at the very step whose grads are new objects
        assert out["history"] == [1] * 5 + [2] * 5, out["history"]
        assert out["disabled"] is None and not out["warnings"], out


def test_moved_param_is_captured_again(ranks):
    for out in ranks(2).run(_rank_trajectory, 5, False, True, True):
        # the step whose param moved runs the generic path (the fast caches are rebuilt): it
        # cannot be captured, the next step is
        assert out["history"] == [1] * 6 + [2] * 4, out["history"]
        assert out["disabled"] is None and not out["warnings"], out


def test_grads_set_to_none_every_step_run_eagerly_with_one_warning(ranks):
    for out in ranks(2).run(_rank_trajectory, None, True, True):
        # captured at the first step; the second step's grads are new: eager from then on
        assert out["history"] == [1] + ["eager"] * 9, out["history"]
        assert len(out["warnings"]) == 1 and "zero_grad(set_to_none=True)" in out["warnings"][0]
        assert out["fast_steps"] == (10, 10), out


def _rank_blocked(kind: str):
    base_cls, kw = {
        "sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9)),
        "foreach": (torch.optim.AdamW, dict(lr=LR, foreach=True)),
    }[kind]
    mesh, [(wc, pc), (we, pe)] = _pair(base_cls, kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            fulls = [torch.randn(s, generator=gen) for s in SHAPES]
            for _, ps in ((wc, pc), (we, pe)):
                _set_grads(ps, fulls, mesh, in_place=True)
            wc.step()
            we.step()
            assert _same((wc, pc), (we, pe)), step
            wc.zero_grad(set_to_none=False)
            we.zero_grad(set_to_none=False)
    return [str(w.message) for w in caught if "cuda_graph" in str(w.message)]


@pytest.mark.parametrize(
    "kind, why",
    [("sgd", "not stepped by the Adam/AdamW fast step"), ("foreach", "not fused=True")],
)
def test_what_cannot_be_captured_runs_eagerly(ranks, kind, why):
    for msgs in ranks(1).run(_rank_blocked, kind):
        assert len(msgs) == 1 and why in msgs[0], msgs


def _rank_refuses_cpu_params():
    from _layouts import get_mesh

    from mfsdp_optim import FullyShardedOptimizer

    ps = _dparams([torch.zeros(4, 2)], get_mesh((1,)))
    try:
        FullyShardedOptimizer(
            torch.optim.AdamW(ps, fused=True), OptimizerConfig(cuda_graph=True, host_sync=False)
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_cpu_params_are_refused(ranks):
    (msg,) = ranks(1).run(_rank_refuses_cpu_params)
    assert msg and "param_groups.0.params.0" in msg and "on the CPU" in msg, msg


def _rank_nan_lr():
    """A scheduler bug after the capture: the lr becomes NaN. The replay does not run: the step
    is refused as the eager step refuses it, nothing updated; a good lr replays again."""
    mesh, [(wc, pc), _] = _pair(torch.optim.AdamW, dict(lr=LR, fused=True))
    out = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        _set_grads(pc, [torch.randn(s, generator=gen) for s in SHAPES], mesh, in_place=True)
        wc.param_groups[0]["lr"] = float("nan") if step == 2 else LR
        before = [p._local_tensor.clone() for p in pc]
        try:
            wc.step()
            out.append("ok")
        except ValueError as exc:
            same = all(torch.equal(b, p._local_tensor) for b, p in zip(before, pc, strict=True))
            out.append(("refused", "nothing was updated" in str(exc), same))
        wc.zero_grad(set_to_none=False)
    return out, wc._captured.graph.captures, wc._captured.graph.replays


def test_nan_lr_is_refused_not_replayed(ranks):
    for out, captures, replays in ranks(1).run(_rank_nan_lr):
        assert out == ["ok", "ok", ("refused", True, True), "ok"], out
        assert captures == 1 and replays == 2, (captures, replays)


def _rank_moves_seen(check_all: bool, split: bool, chunk: int | None = None):
    """After a steady capture: every way a grad or a param's local tensor can move (a new
    object, a new local tensor, the same local tensor moved in place) fails the check before
    the replay, and the next step captures again; put back, the check holds again. Each move
    is made on the first and on the last param (with ``split``, the last is in the second of
    two base optimizers; with ``chunk``, the check's chunks hold that many params)."""
    import os

    from torch.distributed.tensor import DTensor

    from mfsdp_optim._infra.device_table import CHECK_ALL_ENV
    from mfsdp_optim.optim._captured import _step as _captured

    if check_all:
        os.environ[CHECK_ALL_ENV] = "1"
    old_chunk = _captured._CHUNK
    if chunk is not None:
        _captured._CHUNK = chunk
    try:
        mesh, [(wc, pc), _] = _pair(torch.optim.AdamW, dict(lr=LR, fused=True), split=split)
        cs = wc._captured
        gen = torch.Generator().manual_seed(0)
        _set_grads(pc, [torch.randn(s, generator=gen) for s in SHAPES], mesh, in_place=True)
        for _ in range(1 + MIN_REPLAYS):
            wc.step()
        assert cs.graph.captures == 1 and cs.graph.replays == MIN_REPLAYS
        assert len(wc._engines) == (2 if split else 1)

        def swap_grad(p):
            old = p.grad
            p.grad = DTensor.from_local(
                old._local_tensor.clone(),
                mesh,
                old.placements,
                run_check=False,
                shape=old.shape,
                stride=old.stride(),
            )
            return lambda: setattr(p, "grad", old)

        def drop_grad(p):
            old = p.grad
            p.grad = None
            return lambda: setattr(p, "grad", old)

        def swap_attr(obj, name, new):
            old = getattr(obj, name)
            setattr(obj, name, new(old))
            return lambda: setattr(obj, name, old)

        def move_in_place(t):
            old = t.untyped_storage()
            t.set_(t.clone())  # same object, new memory
            return lambda: t.set_(old, 0, t.shape, t.stride())

        def assign_data(t):
            old = t.data  # shares t's memory
            t.data = t.clone()  # same object, its storage replaced
            return lambda: setattr(t, "data", old)

        def swap_tensors(t):
            other = t.clone()
            torch.utils.swap_tensors(t, other)  # same Python object, another tensor inside
            return lambda: torch.utils.swap_tensors(t, other)

        def same_memory_view(t):  # a new local tensor at the same address (another shape)
            return lambda old: old.view(-1) if old.dim() != 1 else old.view(1, -1)

        moves = {
            "new grad object": swap_grad,
            "grad set to None": drop_grad,
            "new grad local tensor": lambda p: swap_attr(p.grad, "_local_tensor", torch.clone),
            "grad local, a view at its address": lambda p: swap_attr(
                p.grad, "_local_tensor", same_memory_view(p.grad._local_tensor)
            ),
            "grad local moved in place": lambda p: move_in_place(p.grad._local_tensor),
            "grad local's .data assigned": lambda p: assign_data(p.grad._local_tensor),
            "grad local swapped (swap_tensors)": lambda p: swap_tensors(p.grad._local_tensor),
            "new param local tensor": lambda p: swap_attr(p, "_local_tensor", torch.clone),
        }
        if check_all:
            moves["param local moved in place"] = lambda p: move_in_place(p._local_tensor)
            moves["param local's .data assigned"] = lambda p: assign_data(p._local_tensor)
        seen = {"nothing moved": cs.still_valid(cs.graph.inputs)}
        for where, p in (("first", pc[0]), ("last", pc[-1])):
            for name, move in moves.items():
                undo = move(p)
                seen[f"{name} ({where} param)"] = cs.still_valid(cs.graph.inputs)
                undo()
                seen[f"{name} ({where} param), put back"] = cs.still_valid(cs.graph.inputs)
        # through the step: a moved grad local is captured again, not replayed
        undo = move_in_place(pc[-1].grad._local_tensor)
        wc.step()
        undo()
        return seen, len(moves), cs.graph.captures, cs.graph.disabled
    finally:
        os.environ.pop(CHECK_ALL_ENV, None)
        _captured._CHUNK = old_chunk


@pytest.mark.parametrize(
    "check_all, split, chunk",
    [(False, False, None), (True, False, None), (False, True, None), (False, False, 2)],
    ids=["default", "check-all-addresses", "two-base-optimizers", "chunks-of-2"],
)
def test_every_move_of_a_grad_or_param_forces_a_capture(ranks, check_all, split, chunk):
    (out,) = ranks(1).run(_rank_moves_seen, check_all, split, chunk)
    seen, moves, captures, disabled = out
    assert seen.pop("nothing moved") is True
    # every move not seen, and every put-back not accepted (each is caught by one comparison)
    missed = sorted(n for n, valid in seen.items() if valid is not n.endswith("put back"))
    assert not missed, missed
    assert moves == (10 if check_all else 8) and len(seen) == 4 * moves, seen
    assert captures == 2 and disabled is None, (captures, disabled)


def _rank_dropped_capture_frees_grads():
    """What the pre-replay check builds once per capture (its chunks) dies with the capture: a
    dropped capture keeps no grad alive once the training loop lets go of it."""
    import gc
    import weakref

    mesh, [(wc, pc), _] = _pair(torch.optim.AdamW, dict(lr=LR, fused=True))
    gen = torch.Generator().manual_seed(0)
    _set_grads(pc, [torch.randn(s, generator=gen) for s in SHAPES], mesh, in_place=True)
    for _ in range(1 + MIN_REPLAYS):
        wc.step()
    cs = wc._captured
    held = cs.still_valid(cs.graph.inputs)  # (builds the chunks)
    grad, local = weakref.ref(pc[-1].grad), weakref.ref(pc[-1].grad._local_tensor)
    cs.graph.drop()
    wc.zero_grad(set_to_none=True)
    gc.collect()
    return held, grad() is None, local() is None


def test_a_dropped_capture_keeps_no_grad_alive(ranks):
    assert ranks(1).run(_rank_dropped_capture_frees_grads) == [(True, True, True)]
