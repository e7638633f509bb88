"""``OptimizerConfig(clip_scope=...)``: which base optimizers are clipped, by which norm.

On real gloo ranks, against brute force over the distinct global tensors (``_layouts``): grads on
mixed dense and expert meshes (sub-meshes whose stripes hold different tensors), spread over 1-4
base optimizers (SGD with lr=1, so a param after one step is ``-coef * grad`` and the clip
coefficient each optimizer got is read off the params). Every scope: ``wrapper.grad_norms`` is
each optimizer's own norm, ``step()``'s norm the global one, each optimizer clipped by the norm
its scope says, every rank bitwise the same, and ONE collective per step (counted) whatever the
number of optimizers and the scope. Then Muon + AdamW with only AdamW clipped against the same two
torch optimizers on the unsharded model (``clip_grad_norm_`` over AdamW's params alone), the
device-only mode, a failing rank, and the config's checks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _collectives import counted
from _layouts import GradSpec, PlacementSpec, build_grad, grad_specs, reference_stats
from hypothesis import given, settings
from hypothesis import strategies as st

MAX_NORMS = (1e-3, 0.5, 1e6)  # clips everything, clips some, clips nothing


def _coef(max_norm: float, norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))


def _build(specs, owners, k, scope, max_norm, norm_type, host_sync=True):
    """A module holding one param per spec, ``k`` SGD optimizers (param i in ``owners[i]``),
    each param's grad the spec's grad, and the wrapper."""
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    grads = [build_grad(s) for s in specs]
    module = torch.nn.Module()
    params = []
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros_like(g))
        module.register_parameter(f"p{i}", p)
        p.grad = g.clone()
        params.append(p)
    opts = [
        torch.optim.SGD([p for p, o in zip(params, owners, strict=True) if o == j], lr=1.0)
        for j in range(k)
    ]
    config = OptimizerConfig(
        clip_grad=max_norm, norm_type=norm_type, clip_scope=scope, host_sync=host_sync
    )
    wrapper = FullyShardedOptimizer(opts, config, model_chunks=[module])
    return wrapper, params, grads


def _rank_scope(specs, owners, k, scope, max_norm, norm_type):
    wrapper, params, grads = _build(specs, owners, k, scope, max_norm, norm_type)
    with counted() as counts:
        ok, norm, _ = wrapper.step()
    # each param after one SGD step with lr=1 from zero: -(its clip coefficient) * grad
    got = []
    for p, g in zip(params, grads, strict=True):
        full_p, full_g = p.full_tensor().double(), g.full_tensor().double()
        got.append((full_p, full_g))
    return ok, norm, wrapper.grad_norms, got, dict(counts)


@st.composite
def _layouts(draw):
    """Specs on one world (dense mesh plus sub-meshes with stripes) and their owners."""
    world = draw(st.sampled_from([4, 8]))
    k = draw(st.integers(1, 4))
    n = draw(st.integers(k, k + 3))
    specs = [draw(grad_specs(world, dtypes=("float32", "bfloat16"))) for _ in range(n)]
    # every optimizer owns at least one param: owner j takes param j, the rest at random
    owners = list(range(k)) + [draw(st.integers(0, k - 1)) for _ in range(n - k)]
    scope = draw(
        st.one_of(
            st.just("global"),
            st.just("per_optimizer"),
            st.sets(st.integers(0, k - 1), max_size=k).map(tuple),
        )
    )
    norm_type = draw(st.sampled_from([2.0, math.inf, 1.5]))
    return world, specs, owners, k, scope, draw(st.sampled_from(MAX_NORMS)), norm_type


def _check(results, specs, owners, k, scope, max_norm, norm_type):
    first = results[0]
    ref_total = reference_stats(specs, norm_type)[0]
    ref = [
        reference_stats([s for s, o in zip(specs, owners, strict=True) if o == j], norm_type)[0]
        for j in range(k)
    ]
    for ok, norm, norms, got, counts in results:
        # every rank the same numbers, bitwise
        assert (ok, norm, norms) == (first[0], first[1], first[2])
        assert sum(counts.values()) == 1, f"expected ONE collective per step, saw {counts}"
        assert ok is True
        assert isinstance(norms, tuple) and len(norms) == k
        assert all(isinstance(v, float) for v in norms)
        assert norm == pytest.approx(ref_total, rel=2e-5, abs=1e-30)
        for j in range(k):
            assert norms[j] == pytest.approx(ref[j], rel=2e-5, abs=1e-30), (j, norms, ref)
        if scope == "global":
            by = [ref_total] * k
        elif scope == "per_optimizer":
            by = ref
        else:
            chosen = [s for s, o in zip(specs, owners, strict=True) if o in scope]
            joint = reference_stats(chosen, norm_type)[0]
            by = [joint if j in scope else None for j in range(k)]
        for (full_p, full_g), o, spec in zip(got, owners, specs, strict=True):
            coef = 1.0 if by[o] is None else _coef(max_norm, by[o])
            # the clip multiplies in the grad's dtype: bf16 grads round once (2**-8 relative)
            rtol = 1e-2 if spec.dtype == "bfloat16" else 1e-4
            expect = -coef * full_g
            assert torch.allclose(full_p, expect, rtol=rtol, atol=0.0), (o, coef)


@settings(max_examples=25, deadline=None)
@given(case=_layouts())
def test_every_scope_matches_brute_force_per_optimizer(ranks, case):
    world, specs, owners, k, scope, max_norm, norm_type = case
    results = ranks(world).run(_rank_scope, specs, owners, k, scope, max_norm, norm_type)
    _check(results, specs, owners, k, scope, max_norm, norm_type)


_S, _R = PlacementSpec("S", 0), PlacementSpec("R")
# dense grads over all 8 ranks and expert grads on the 4-rank stripes of a (2, 4) mesh
_MIXED = [
    GradSpec((37, 5), (8,), (0,), (_S,), seed=1),
    GradSpec((3,), (8,), (0,), (_S,), seed=2),  # empty shards
    GradSpec((11, 4), (2, 4), (1,), (_S,), seed=3, scale=1e3),
    GradSpec((6,), (2, 4), (1,), (_R,), seed=4),
    GradSpec((9, 2), (2, 4), (0, 1), (_R, _S), seed=5, scale=1e-3),
]


@pytest.mark.parametrize("scope", ["global", "per_optimizer", (0,), (1, 2), (), (0, 1, 2)], ids=str)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_dense_and_expert_grads_over_three_optimizers(ranks, scope, norm_type):
    owners = [0, 1, 1, 2, 0]
    results = ranks(8).run(_rank_scope, _MIXED, owners, 3, scope, 0.5, norm_type)
    _check(results, _MIXED, owners, 3, scope, 0.5, norm_type)


def _rank_count(k, scope, host_sync, scaler, steps):
    from mfsdp_optim import DynamicGradScaler, FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim import _optimizer  # noqa: F401  (imported before counting)

    specs = [GradSpec((7, 3), (4,), (0,), (_S,), seed=i) for i in range(k + 1)]
    owners = list(range(k)) + [0]
    wrapper, params, _ = _build(specs, owners, k, scope, 0.5, 2.0, host_sync=host_sync)
    if scaler:
        wrapper.grad_scaler = DynamicGradScaler(initial_scale=1.0)
    config = wrapper.config
    assert isinstance(config, OptimizerConfig) and isinstance(wrapper, FullyShardedOptimizer)
    per_step = []
    for step in range(steps):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(
                GradSpec(s.shape, s.mesh_shape, s.used_dims, s.placements, seed=step)
            )
        with counted() as counts:
            out = wrapper.step()
            norms = wrapper.grad_norms
            last = (wrapper.last_update_successful, wrapper.last_grad_norm, wrapper.last_num_zeros)
            # the record of the last step is what step() returned (the same device tensors)
            assert all(a is b for a, b in zip(last, out, strict=True)), (last, out)
            if not host_sync:  # reading the device values is the caller's business
                out = tuple(v if v is None else v.item() for v in out)
                norms = tuple(v.item() for v in norms)
        per_step.append((dict(counts), out, norms))
        wrapper.zero_grad()
    return per_step


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("scope", ["global", "per_optimizer", "subset"])
@pytest.mark.parametrize("host_sync,scaler", [(True, False), (True, True), (False, False)])
def test_one_collective_per_step_for_any_count_and_scope(ranks, k, scope, host_sync, scaler):
    chosen = (k - 1,) if scope == "subset" else scope
    results = ranks(4).run(_rank_count, k, chosen, host_sync, scaler, 3)
    for per_step in results:
        assert per_step == results[0], "ranks disagree"
        for counts, (ok, _, _), norms in per_step:
            assert sum(counts.values()) == 1, counts
            assert ok
            assert len(norms) == k and all(math.isfinite(v) and v > 0 for v in norms)


def _rank_device_norms():
    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    specs = [GradSpec((7, 3), (4,), (0,), (_S,), seed=i) for i in range(3)]
    out = {}
    for host_sync in (True, False):
        wrapper, _, _ = _build(specs, [0, 1, 1], 2, "per_optimizer", 0.5, 2.0, host_sync)
        assert isinstance(wrapper, FullyShardedOptimizer)
        assert isinstance(wrapper.config, OptimizerConfig)
        assert wrapper.grad_norms == ()
        wrapper.step()
        out[host_sync] = wrapper.grad_norms
    return out


def test_device_only_norms_are_tensors_equal_to_the_host_ones(ranks):
    for out in ranks(4).run(_rank_device_norms):
        on_host, on_device = out[True], out[False]
        assert all(isinstance(v, float) for v in on_host)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in on_device)
        assert [float(v) for v in on_device] == list(on_host)


# ---------------------------------------------------------------------------------------------
# Muon + AdamW, only AdamW clipped, against the unsharded torch optimizers


def _global_grad(name, shape, step):
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(shape, generator=gen) * 3.0


def _rank_muon_adamw(scope, steps):
    from _models import _model, _shard
    from torch.distributed.tensor import distribute_tensor

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    mesh = _mesh_1d()
    model = _model(0)
    _shard(model, mesh)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    wrapper = FullyShardedOptimizer(
        [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=0.01)],
        OptimizerConfig(clip_grad=0.3, clip_scope=scope),
        model_chunks=[model],
    )
    norms = []
    for step in range(steps):
        for name, p in model.named_parameters():
            g = _global_grad(name, p.shape, step)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        wrapper.step()
        norms.append(wrapper.grad_norms)
        wrapper.zero_grad()
    return norms, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _mesh_1d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _unsharded_muon_adamw(scope, steps):
    from _models import _model

    model = _model(0)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    groups = [matrices, rest]
    opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=0.01)]
    norms = []
    for step in range(steps):
        for name, p in model.named_parameters():
            p.grad = _global_grad(name, p.shape, step)
        own = tuple(
            float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in g])))
            for g in groups
        )
        norms.append(own)
        clipped = (0, 1) if scope == "global" else scope
        if scope == "global":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        elif scope == "per_optimizer":
            for g in groups:
                torch.nn.utils.clip_grad_norm_(g, 0.3)
        else:
            torch.nn.utils.clip_grad_norm_([p for i in clipped for p in groups[i]], 0.3)
        for o in opts:
            o.step()
            o.zero_grad()
    return norms, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scope", [(1,), "per_optimizer", "global"], ids=str)
def test_muon_adamw_follow_torch_with_the_scope_clip(ranks, scope):
    want_norms, want = _unsharded_muon_adamw(scope, 3)
    for norms, got in ranks(4).run(_rank_muon_adamw, scope, 3):
        for g, w in zip(norms, want_norms, strict=True):
            assert g == pytest.approx(w, rel=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# a failing rank with several optimizers, and the config's checks


def _rank_one_bad(bad_rank):
    specs = [GradSpec((7, 3), (4,), (0,), (_S,), seed=i) for i in range(3)]
    wrapper, params, _ = _build(specs, [0, 1, 1], 2, "per_optimizer", 0.5, 2.0)
    if dist.get_rank() == bad_rank:
        params[2].grad = torch.ones(7, 3)  # a plain tensor where a DTensor belongs: refused
    try:
        wrapper.step()
    except Exception as exc:
        return type(exc).__name__, str(exc), params[0].full_tensor().abs().sum().item()
    return "ok", "", 0.0


@pytest.mark.timeout(60)
def test_a_refused_grad_on_one_rank_raises_on_every_rank_and_steps_nothing(ranks):
    results = ranks(4).run(_rank_one_bad, 2)
    for rank, (kind, msg, moved) in enumerate(results):
        assert moved == 0.0, "a param moved on a refused step"
        if rank == 2:
            assert kind == "TypeError" and "p2" in msg, msg
        else:
            assert kind == "RankFailedError" and "rank 2" in msg, msg


def test_config_checks_the_scope():
    from mfsdp_optim import OptimizerConfig

    assert OptimizerConfig().clip_scope == "global"
    assert OptimizerConfig(clip_scope={2, 0}).clip_scope == (0, 2)
    assert OptimizerConfig(clip_scope=[]).clip_scope == ()
    for bad, err in [
        ("adamw", ValueError),
        (3, TypeError),
        ([True], TypeError),
        ([-1], TypeError),
        ([0.5], TypeError),
        ([1, 1], ValueError),
    ]:
        with pytest.raises(err, match="clip_scope"):
            OptimizerConfig(clip_scope=bad)
    with pytest.raises(TypeError):
        OptimizerConfig(0.5, 2.0, False, None, "global")  # type: ignore[misc]  # keyword-only


def _rank_index_out_of_range():
    specs = [GradSpec((7, 3), (4,), (0,), (_S,), seed=i) for i in range(2)]
    try:
        _build(specs, [0, 1], 2, (2,), 0.5, 2.0)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_an_index_past_the_optimizers_is_refused_at_construction(ranks):
    for msg in ranks(4).run(_rank_index_out_of_range):
        assert "base optimizer 2" in msg and "has 2" in msg, msg


# ---------------------------------------------------------------------------------------------
# CUDA (skipped here): the fused stats kernel per base optimizer, the clip folded into torch's
# fused AdamW or the Triton update, no host sync under host_sync=False


@pytest.mark.cuda
@pytest.mark.parametrize("scope", ["per_optimizer", (1,)], ids=str)
@pytest.mark.parametrize("host_sync", [True, False])
@pytest.mark.parametrize("triton", [False, True])
def test_clip_scope_on_cuda_follows_torch(tmp_path, scope, host_sync, triton):
    """World size 1 on NCCL: two fused AdamWs (grads of very different scales), clipped per
    scope, against the same two torch AdamWs on plain tensors with ``clip_grad_norm_`` per
    scope; ``grad_norms`` against brute force; steady steps under
    ``torch.cuda.set_sync_debug_mode("error")`` when ``host_sync=False``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    if triton and not TritonAdam.available():
        pytest.skip("needs Triton")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        gen = torch.Generator().manual_seed(0)
        shapes = [(64, 33), (7,), (128, 64), (5,)]
        values = [torch.randn(s, generator=gen).cuda() for s in shapes]

        def on_mesh(t):
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

        params = [torch.nn.Parameter(on_mesh(v.clone())) for v in values]
        ref = [torch.nn.Parameter(v.clone()) for v in values]
        kw = dict(lr=0.01, fused=True)
        wrapper = FullyShardedOptimizer(
            [torch.optim.AdamW(params[:2], **kw), torch.optim.AdamW(params[2:], **kw)],
            OptimizerConfig(
                clip_grad=0.5, clip_scope=scope, host_sync=host_sync, triton_adam_step=triton
            ),
            model_chunks=[torch.nn.ParameterList(params)],
        )
        ref_opts = [torch.optim.AdamW(ref[:2], **kw), torch.optim.AdamW(ref[2:], **kw)]
        for step in range(4):
            grads = [
                torch.randn(s, generator=gen).cuda() * (30.0 if i >= 2 else 0.3)
                for i, s in enumerate(shapes)
            ]
            for p, r, g in zip(params, ref, grads, strict=True):
                p.grad, r.grad = on_mesh(g.clone()), g.clone()
            if step > 0 and not host_sync:
                torch.cuda.set_sync_debug_mode("error")
            try:
                wrapper.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got = [float(v) for v in wrapper.grad_norms]
            want = [
                float(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in part])))
                for part in (grads[:2], grads[2:])
            ]
            assert got == pytest.approx(want, rel=1e-5)
            if scope == "per_optimizer":
                torch.nn.utils.clip_grad_norm_(ref[:2], 0.5)
            torch.nn.utils.clip_grad_norm_(ref[2:], 0.5)
            for o in ref_opts:
                o.step()
                o.zero_grad()
            wrapper.zero_grad()
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
