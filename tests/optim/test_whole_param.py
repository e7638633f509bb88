"""The whole-param step (optim/_whole) against stock torch on the unsharded params.

Muon and Adafactor (and an unknown whole-param class) stepped through ``step_whole_params`` on
real gloo ranks, layouts drawn as ``_layouts.GradSpec`` (1-D uneven and empty shards, HSDP,
2-D, _StridedShard, experts on sub-meshes holding different values); reference: the same class
over this rank's stripe's global tensors in one process, compared with torch.equal. Pieces are
checked against DTensor's own ``full_tensor()``; traffic and owner balance are counted from the
pure planner over a Llama-1B-like set of matrices, and the runtime counter must agree with it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _layouts import GradSpec, PlacementSpec, grad_specs, stripe_of  # noqa: E402
from _ranks import get_pool  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mfsdp_optim.optim._whole._pieces import piece_numel, piece_of  # noqa: E402
from mfsdp_optim.optim._whole._plan import ParamMeta, muon_splits, plan_units  # noqa: E402

S, R = PlacementSpec("S", 0), PlacementSpec("R")


class NormalizedSGD(torch.optim.Optimizer):
    """An unknown class whose update reads the whole param: p -= lr * g / ||g||."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st_ = self.state[p]
                    st_["count"] = st_.get("count", 0) + 1
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


OPTIMIZERS = {
    "Muon": (torch.optim.Muon, dict(lr=0.02, weight_decay=0.1)),
    "MuonPlain": (torch.optim.Muon, dict(lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw")),
    "Adafactor": (torch.optim.Adafactor, dict(lr=0.01, weight_decay=0.01)),
    "NormalizedSGD": (NormalizedSGD, dict(lr=0.1)),
}


def _spec(shape, mesh, placements, used=None, dtype="float32", seed=0):
    used = tuple(range(len(mesh))) if used is None else used
    return GradSpec(tuple(shape), tuple(mesh), used, tuple(placements), dtype=dtype, seed=seed)


def _param_spec(spec):
    return dataclasses.replace(spec, zero_fraction=0.0, scale=1.0, seed=spec.seed + 7919)


def _grad_spec(spec, step):
    return dataclasses.replace(spec, seed=spec.seed + 1_000_003 * (step + 1))


def _full(v):
    from torch.distributed.tensor import DTensor

    return v.full_tensor() if isinstance(v, DTensor) else v


def _same_value(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, (list, tuple)):  # e.g. a list of tensors
        return (
            type(got) is type(want)
            and len(got) == len(want)
            and all(_same_value(_full(g), w) for g, w in zip(got, want, strict=True))
        )
    return got == want


def _assert_like_reference(opt, ref_opt, params, ref, specs):
    """The sharded run equals the unsharded one bit for bit: every param, every state entry
    (param-shaped ones held as DTensors, not whole), every optimizer-level entry."""
    for i, (p, r) in enumerate(zip(params, ref, strict=True)):
        assert torch.equal(p.full_tensor(), r.detach()), f"param {i} ({specs[i]})"
        mine, theirs = opt.state[p], ref_opt.state[r]
        assert list(mine) == list(theirs), (list(mine), list(theirs))
        for k, v in theirs.items():
            got = _full(mine[k])
            assert _same_value(got, v), (i, k)
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == r.shape:
                assert got is not mine[k], "param-shaped state is a DTensor"
    for k in [k for k in ref_opt.state if not isinstance(k, torch.Tensor)]:
        assert _same_value(_full(opt.state[k]), ref_opt.state[k]), k  # e.g. MADGRAD's k


def _rank_train(specs, opt_name, steps=3, break_it=False):
    import torch.distributed as dist
    from _layouts import build_grad, global_tensor

    from mfsdp_optim.optim._whole import step_whole_params
    from mfsdp_optim.optim._whole._exchange import TRAFFIC
    from mfsdp_optim.optim._whole._pieces import describe, extract
    from mfsdp_optim.optim._whole._plan import muon_splits

    cls, kw = OPTIMIZERS[opt_name]
    rank = dist.get_rank()
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params if params else [{"params": []}], **kw)
    ref = [torch.nn.Parameter(global_tensor(_param_spec(s), stripe_of(rank, s))) for s in specs]
    ref_opt = cls(ref if ref else [{"params": []}], **kw)
    for p, r in zip(params, ref, strict=True):  # pieces: as DTensor holds them (build_grad checks)
        mesh = p.device_mesh
        piece = piece_of(
            tuple(p.shape),
            tuple(mesh.shape),
            tuple(mesh.get_coordinate()),
            tuple(describe(pl, "p") for pl in p.placements),
        )
        assert torch.equal(extract(r.detach(), piece), p._local_tensor), (p.placements, piece)
    plan = None
    TRAFFIC.clear()
    predicted = 0
    for step in range(steps):
        for p, r, s in zip(params, ref, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
            r.grad = global_tensor(_grad_spec(s, step), stripe_of(rank, s)).to(p.dtype)
        plan = step_whole_params(opt, params, plan_cache=plan)
        ref_opt.step()
        if opt_name == "Muon":
            predicted += sum(muon_splits(plan.units, rank, plan.world)[0])
    if break_it:  # the check below must notice a one-ulp change
        params[0]._local_tensor.view(-1)[:1].add_(1e-3)
    _assert_like_reference(opt, ref_opt, params, ref, specs)
    for g, saved in zip(opt.param_groups, [params], strict=False):
        assert all(a is b for a, b in zip(g["params"], saved, strict=True)), "lists restored"
    if opt_name == "Muon":
        assert TRAFFIC[("muon_in", "sent")] == predicted, (dict(TRAFFIC), predicted)
    return True


W4 = (4,)
LAYOUTS = {
    "1d-uneven-empty-2": (2, [_spec((5, 3), (2,), [S]), _spec((1, 4), (2,), [S], seed=1)]),
    "1d-uneven-empty-4": (
        4,
        [_spec((3, 5), W4, [S]), _spec((6, 2), W4, [PlacementSpec("S", 1)], seed=1)],
    ),
    "hsdp-2x2": (4, [_spec((5, 4), (2, 2), [R, S]), _spec((3, 7), (2, 2), [R, S], seed=2)]),
    "2d-shard-shard": (
        4,
        [_spec((5, 7), (2, 2), [S, PlacementSpec("S", 1)]), _spec((4, 3), (2, 2), [S, S], seed=3)],
    ),
    "strided": (
        4,
        [
            _spec((8, 3), (2, 2), [PlacementSpec("SS", 0, 2), S]),
            _spec((4, 6), (2, 2), [PlacementSpec("SS", 1, 2), PlacementSpec("S", 1)], seed=4),
        ],
    ),
    "dense-plus-experts": (
        4,
        [
            _spec((6, 5), W4, [S]),
            _spec((5, 3), (2, 2), [S], used=(1,), seed=5),
            _spec((3, 4), (2, 2), [PlacementSpec("S", 1)], used=(1,), seed=6),
        ],
    ),
}


@pytest.mark.parametrize("opt_name", ["Muon", "MuonPlain", "Adafactor", "NormalizedSGD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bit_for_bit_vs_unsharded(layout, opt_name):
    world, specs = LAYOUTS[layout]
    assert all(get_pool(world).run(_rank_train, specs, opt_name))


def test_bf16_muon_without_nesterov_aliases_the_buffer():
    specs = [_spec((6, 5), W4, [S], dtype="bfloat16"), _spec((3, 9), W4, [S], dtype="bfloat16")]
    assert all(get_pool(4).run(_rank_train, specs, "MuonPlain"))


def test_a_broken_update_is_noticed():
    with pytest.raises(AssertionError, match="param 0"):
        get_pool(2).run(_rank_train, LAYOUTS["1d-uneven-empty-2"][1], "Muon", break_it=True)


@st.composite
def _cases(draw):
    world = draw(st.sampled_from([2, 4]))
    opt_name = draw(st.sampled_from(["Muon", "Adafactor", "NormalizedSGD"]))
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        spec = draw(grad_specs(world, dtypes=("float32",)))
        shape = spec.shape
        if opt_name == "Muon":  # 2-D: 1 x n, n x 1, tiny, uneven
            shape = (max(1, draw(st.integers(1, 9))), max(1, draw(st.integers(1, 9))))
            keep = [
                p if p.dim < 2 else dataclasses.replace(p, dim=p.dim % 2) for p in spec.placements
            ]
            spec = dataclasses.replace(spec, placements=tuple(keep))
        shape = tuple(max(1, n) for n in shape)  # empty params: nan in Adafactor either way
        spec = dataclasses.replace(spec, shape=shape, zero_fraction=0.0)
        if any(p.kind == "SS" for p in spec.placements):
            from _layouts import valid_strided

            if not valid_strided(spec):
                continue
        specs.append(spec)
    return world, opt_name, specs


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(_cases())
def test_hypothesis_shapes_and_layouts(case):
    world, opt_name, specs = case
    assert all(get_pool(world).run(_rank_train, specs, opt_name, steps=2))


def _rank_fail_at_step_two(specs, opt_name, bad_rank):
    import torch.distributed as dist
    from _layouts import build_grad

    from mfsdp_optim.optim._whole import step_whole_params

    cls, kw = OPTIMIZERS[opt_name]
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    plan = None
    for step in range(2):
        for p, s in zip(params, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False)
        if step == 1 and dist.get_rank() == bad_rank:
            from torch.distributed.tensor import DTensor, Shard

            g = params[0].grad  # the same values claimed as Shard(1): a layout mismatch
            params[0].grad = DTensor.from_local(
                g.to_local(),
                g.device_mesh,
                [Shard(1)],
                run_check=False,
                shape=g.shape,
                stride=g.stride(),
            )
        try:
            plan = step_whole_params(opt, params, plan_cache=plan)
        except (ValueError, RuntimeError) as exc:
            return step, type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("opt_name", ["Muon", "Adafactor"])
def test_a_rank_failing_locally_does_not_hang_its_peers(opt_name):
    specs = LAYOUTS["dense-plus-experts"][1]
    out = get_pool(4).run(_rank_fail_at_step_two, specs, opt_name, 1)
    assert out[1][:2] == (1, "ValueError") and "is not the param's" in out[1][2]
    for r in (0, 2, 3):  # every rank shares the dense param with rank 1
        assert out[r][:2] == (1, "RankFailedError") and "failed on rank 1 " in out[r][2], out[r]


def test_a_refused_layout_is_refused_on_every_rank_at_planning():
    specs = [_spec((4, 3, 2), W4, [S])]  # Muon takes 2-D params only; torch's check is skipped
    out = get_pool(4).run(_rank_plan_refused, specs)
    assert all("Muon takes 2-D params" in o for o in out), out


def _rank_plan_refused(specs):
    from _layouts import build_grad

    from mfsdp_optim.optim._whole import step_whole_params

    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    opt.param_groups[0]["params"][:] = params  # past Muon's own constructor check
    try:
        step_whole_params(opt, params)
    except ValueError as exc:
        return str(exc)
    return "no error"


# ---------------------------------------------------------------------------------------------
# traffic and owner balance, from the pure planner (Llama-1B-like matrices)


def _llama_metas(world, dtype="torch.bfloat16"):
    shapes = {"q": (2048, 2048), "k": (512, 2048), "v": (512, 2048), "o": (2048, 2048)}
    shapes |= {"gate": (5632, 2048), "up": (5632, 2048), "down": (2048, 5632)}
    metas = [
        ParamMeta(f"layers.{i}.{n}", tuple(range(world)), (world,), (("S", 0),), shape, dtype)
        for i in range(16)
        for n, shape in shapes.items()
    ]
    return [metas] * world


@pytest.mark.parametrize("world", [2, 4, 8])
def test_muon_traffic_within_twice_the_local_shard_bytes(world):
    units = plan_units(_llama_metas(world), "muon")
    for rank in range(world):
        local_bytes = 2 * sum(  # bfloat16 params: the tightest case
            piece_numel(u.pieces[u.members.index(rank)]) for u in units
        )
        send_in, recv_in, send_out, recv_out = muon_splits(units, rank, world)
        # everything this rank sends in a step (its inputs out, the results it owns back),
        # and everything it receives, each at most 1.1 x twice its local shard bytes
        sent, received = sum(send_in) + sum(send_out), sum(recv_in) + sum(recv_out)
        assert sent <= 1.1 * 2 * local_bytes, (world, rank, sent, local_bytes)
        assert received <= 1.1 * 2 * local_bytes, (world, rank, received, local_bytes)
        # each rank's own input travels once, less what it keeps as owner
        assert sum(send_in) < local_bytes + 8 * world


def test_owner_balance_at_8_ranks():
    units = plan_units(_llama_metas(8), "muon")
    flops = [0] * 8
    for u in units:
        flops[u.owner] += u.cost
    assert max(flops) <= 1.15 * (sum(flops) / 8), flops
    # owners come from the shard group and the plan is deterministic
    assert units == plan_units(_llama_metas(8), "muon")


def test_muon_owners_span_the_replicas_on_hsdp():
    metas = [
        ParamMeta(f"w{i}", (0, 1, 2, 3), (2, 2), (("R",), ("S", 0)), (64, 32), "torch.float32")
        for i in range(6)
    ]
    units = plan_units([metas] * 4, "muon")
    # Muon: one unit per param, its owner any rank of any replica group; its shard group sends
    # the input, the other replica group only receives the result
    assert len(units) == 6
    for u in units:
        assert u.owner in u.members and len(u.members) == 2
        assert len(u.receivers) == 2 and not set(u.receivers) & set(u.members)
        assert {u.members, u.receivers} == {(0, 1), (2, 3)}
    counts = [sum(u.owner == r for u in units) for r in range(4)]
    assert sorted(counts) == [1, 1, 2, 2]
    # the generic path spans them too where the shards are even (no piece over half the param)
    generic = plan_units([metas] * 4, "generic")
    assert len(generic) == 6 and all(len(u.receivers) == 2 for u in generic)
    # one unit per replica group where asked
    per_replica = plan_units([metas] * 4, "generic", span_replicas=False)
    assert len(per_replica) == 12 and all(not u.receivers for u in per_replica)
