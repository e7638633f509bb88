"""``check_layout``: params whose mesh instances hold identical copies, on real gloo ranks.

Layouts built by hand on 4 ranks: a (dp, tp) = 2x2 mesh with a LayerNorm-like param left on the
1-D dp mesh (flagged, and the grad norm over-counts it by exactly what the report says), the same
model laid out correctly (clean), and dense params on all 4 ranks beside expert params on
expert-data-parallel stripes, including zero-initialised expert biases (clean). Liveness: the
expert layout with every stripe given the same values is flagged.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from _layouts import get_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _param(module, name, global_value, mesh, placements, grad=None):
    """Register ``name`` on ``module`` as a DTensor param cut from ``global_value`` (no comms:
    each rank slices the global tensor it built itself)."""
    p = torch.nn.Parameter(distribute_tensor(global_value, mesh, placements, src_data_rank=None))
    if grad is not None:
        p.grad = distribute_tensor(grad, mesh, placements, src_data_rank=None)
    module.register_parameter(name, p)
    return p


def _tp_model(ln_on_dp_mesh: bool, grads: bool, ln_values: str):
    """W (8x6) on the 2x2 (dp, tp) mesh as (Shard(0), Shard(1)); ``ln_weight`` (6,) either on
    the 1-D dp mesh (Shard(0): left off the TP plan) or on the 2-D mesh (Shard(0), Replicate())."""
    mesh = get_mesh((2, 2))
    dp = get_mesh((2, 2), (0,))
    m = torch.nn.Module()
    _param(
        m, "w", _randn((8, 6), 1), mesh, [Shard(0), Shard(1)], _randn((8, 6), 2) if grads else None
    )
    ln = torch.ones(6) if ln_values == "ones" else _randn(6, 3)
    ln_grad = _randn(6, 4) if grads else None
    if ln_on_dp_mesh:
        _param(m, "ln_weight", ln, dp, [Shard(0)], ln_grad)
    else:
        _param(m, "ln_weight", ln, mesh, [Shard(0), Replicate()], ln_grad)
    return m


def _run_check(model):
    from mfsdp_optim import check_layout

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = check_layout(model)
    return found, [str(w.message) for w in caught]


def _rank_tp(ln_on_dp_mesh, grads, ln_values):
    import mfsdp_optim

    model = _tp_model(ln_on_dp_mesh, grads, ln_values)
    found, messages = _run_check(model)
    norm = ref = None
    if grads:
        norm = float(mfsdp_optim.get_grad_norm([p.grad for p in model.parameters()]))
        # the distinct global tensors, brute force
        ref = math.sqrt(
            float(_randn((8, 6), 2).double().square().sum() + _randn(6, 4).double().square().sum())
        )
    return found, messages, norm, ref


def _expert_model(same_experts: bool, grads: bool):
    """Dense ``w`` on the 4-rank mesh (Shard(0)); experts on the 2x2 mesh's ep stripes: each
    1-D edp mesh (d0: ranks {0, 2} and {1, 3}) holds its own expert ``experts.w`` (values
    seeded by the stripe) and a zero-initialised bias whose grads differ per expert."""
    rank = dist.get_rank()
    dense = get_mesh((4,))
    edp = get_mesh((2, 2), (0,))
    stripe = get_mesh((2, 2)).get_coordinate()[1]
    seed = 0 if same_experts else stripe
    m = torch.nn.Module()
    _param(m, "w", _randn((8, 4), 10), dense, [Shard(0)], _randn((8, 4), 11) if grads else None)
    experts = torch.nn.Module()
    m.add_module("experts", experts)
    _param(
        experts,
        "w",
        _randn((4, 6), 20 + seed),
        edp,
        [Shard(0)],
        _randn((4, 6), 30 + seed) if grads else None,
    )
    _param(experts, "b", torch.zeros(6), edp, [Shard(0)], _randn(6, 40 + seed) if grads else None)
    assert rank in edp.mesh.flatten().tolist()
    return m


def _rank_experts(same_experts, grads):
    return _run_check(_expert_model(same_experts, grads))


def _rank_compiled_names():
    """A model wrapped the way torch.compile wraps it reports FQNs without ``_orig_mod.``."""
    from mfsdp_optim import check_layout

    outer = torch.nn.Module()
    outer.add_module("_orig_mod", _tp_model(True, True, "randn"))
    return [d.fqn for d in check_layout(outer, warn=False)]


def _rank_no_params():
    """Ranks 2, 3 hold nothing and still call (the gather is collective)."""
    from mfsdp_optim import check_layout

    model = _tp_model(True, True, "randn") if dist.get_rank() < 2 else torch.nn.Module()
    return check_layout(model, warn=False)


# ---------------------------------------------------------------------------------------------


def test_param_left_off_the_tp_plan_is_flagged(ranks):
    pool = ranks(4)
    for grads, ln_values in ((True, "ones"), (True, "randn"), (False, "randn")):
        results = pool.run(_rank_tp, True, grads, ln_values)
        for found, messages, norm, ref in results:
            assert [d.fqn for d in found] == ["ln_weight"], (grads, ln_values, found)
            d = found[0]
            assert d.copies == 2 and d.meshes == ((0, 2), (1, 3)), d
            assert d.evidence == ("values+grads" if grads else "values")
            assert len(messages) == 1 and "ln_weight (2 identical copies" in messages[0]
            if grads:
                # the over-count the report explains: ln_weight's squares counted twice
                w2 = float(_randn((8, 6), 2).double().square().sum())
                ln2 = float(_randn(6, 4).double().square().sum())
                assert math.isclose(norm, math.sqrt(w2 + d.copies * ln2), rel_tol=1e-6)
                assert not math.isclose(norm, ref, rel_tol=1e-3), (norm, ref)
        assert all(r[0] == results[0][0] for r in results)  # the same verdict on every rank


def test_correct_tp_layout_is_clean(ranks):
    pool = ranks(4)
    for grads, ln_values in ((True, "ones"), (True, "randn"), (False, "randn")):
        for found, messages, norm, ref in pool.run(_rank_tp, False, grads, ln_values):
            assert found == [] and messages == [], found
            if grads:
                assert math.isclose(norm, ref, rel_tol=1e-6), (norm, ref)


def test_constant_shards_without_grads_are_not_evidence(ranks):
    """LayerNorm ones before any backward: identical, but so would be any two fresh norms."""
    for found, messages, _, _ in ranks(4).run(_rank_tp, True, False, "ones"):
        assert found == [] and messages == []


def test_expert_meshes_are_clean(ranks):
    pool = ranks(4)
    for grads in (True, False):
        for found, messages in pool.run(_rank_experts, False, grads):
            assert found == [] and messages == [], (grads, found)


def test_identical_experts_are_flagged(ranks):
    """Liveness: the expert layout with every stripe holding the same values and grads."""
    for found, _ in ranks(4).run(_rank_experts, True, True):
        assert [(d.fqn, d.copies) for d in found] == [("experts.b", 2), ("experts.w", 2)]


def test_ranks_without_params_take_part(ranks):
    results = ranks(4).run(_rank_no_params)
    # ranks 0 and 1 hold dp coordinate 0 of the two tp instances ({0, 2}, {1, 3}) of ln_weight:
    # the same shard at the same position, so it is flagged, on every rank alike
    assert [(d.fqn, d.copies) for d in results[0]] == [("ln_weight", 2)]
    assert all(r == results[0] for r in results)


def test_compiled_model_fqns_have_no_orig_mod(ranks):
    assert ranks(4).run(_rank_compiled_names) == [["ln_weight"]] * 4
