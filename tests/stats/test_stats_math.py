"""The pure stats core in one process: simulated ranks, many hypothesis examples.

Every rank of a simulated mesh cuts its shard of the global tensor with the test suite's own
slicing (``_layouts.local_shard``), derives replication and its canonical flag from the mesh
coordinates by hand (not through the library's ``_placement``), and contributes through
``shard_contribution``; the combined contributions must match a float64 brute force over the
global tensor.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _layouts import PlacementSpec, global_tensor, grad_specs, local_shard
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp_optim.stats._math import (
    NONFINITE_SLOT,
    NORM_SLOT,
    ZEROS_SLOT,
    check_norm_type,
    combine_contributions,
    empty_contribution,
    finish_norm,
    shard_contribution,
)

NORM_TYPES = [0.5, 1.0, 2.0, 3.0, math.inf]


def _simulate(spec, norm_type):
    """Contributions of every coordinate of the spec's (unstriped) mesh."""
    g = global_tensor(spec, ())
    rows = []
    for coord in itertools.product(*(range(n) for n in spec.mesh_shape)):
        local = local_shard(g, spec, coord)
        if local.numel() == 0:
            continue
        replicated = [d for d, p in enumerate(spec.placements) if p.kind == "R"]
        replication = math.prod(spec.mesh_shape[d] for d in replicated)
        canonical = all(coord[d] == 0 for d in replicated)
        rows.append(
            shard_contribution(
                [local],
                norm_type=norm_type,
                replication=replication,
                canonical=canonical,
                count_zeros=True,
            )
        )
    rows.append(empty_contribution(torch.device("cpu")))
    return g, combine_contributions(torch.stack(rows), norm_type)


@settings(max_examples=200)
@given(
    data=st.data(), world=st.sampled_from([1, 2, 3, 4, 6, 8]), norm_type=st.sampled_from(NORM_TYPES)
)
def test_simulated_ranks_match_brute_force(data, world, norm_type):
    spec = data.draw(grad_specs(world, allow_stripes=False))
    g, total = _simulate(spec, norm_type)
    v = g.double().flatten()
    expected = torch.linalg.vector_norm(v, norm_type) if v.numel() else torch.tensor(0.0)
    got = finish_norm(total[NORM_SLOT], norm_type)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-30)
    assert int(total[ZEROS_SLOT]) == int((v == 0).sum())
    assert int(total[NONFINITE_SLOT]) == 0


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_nonfinite_is_flagged_and_poisons_the_norm(norm_type):
    clean = torch.ones(5)
    for bad in (math.nan, math.inf, -math.inf):
        dirty = torch.tensor([1.0, bad, 0.0])
        row = shard_contribution(
            [clean, dirty], norm_type=norm_type, replication=2, canonical=True, count_zeros=True
        )
        assert row[NONFINITE_SLOT] == 1
        assert not torch.isfinite(row[NORM_SLOT])
        assert row[ZEROS_SLOT] == 1  # NaN and inf are not zeros


def test_float64_accumulation_survives_float32_overflow():
    huge = torch.full((16,), 1e30)  # squares overflow float32, not float64
    row = shard_contribution(
        [huge], norm_type=2.0, replication=1, canonical=True, count_zeros=False
    )
    assert row[NONFINITE_SLOT] == 0
    assert finish_norm(row[NORM_SLOT], 2.0).item() == pytest.approx(4e30, rel=1e-6)


def test_zero_count_is_exact_past_float32_integers():
    n = 2**24 + 3  # float32 cannot hold this count; the core must
    row = shard_contribution(
        [torch.zeros(n, dtype=torch.bfloat16)],
        norm_type=2.0,
        replication=1,
        canonical=True,
        count_zeros=True,
    )
    assert int(row[ZEROS_SLOT].item()) == n


def test_replicas_count_norm_share_and_no_zeros():
    t = torch.tensor([3.0, 0.0, 4.0])
    canon = shard_contribution([t], norm_type=2.0, replication=4, canonical=True, count_zeros=True)
    replica = shard_contribution(
        [t], norm_type=2.0, replication=4, canonical=False, count_zeros=True
    )
    assert canon[NORM_SLOT].item() == pytest.approx(25 / 4)
    assert replica[NORM_SLOT].item() == pytest.approx(25 / 4)
    assert (canon[ZEROS_SLOT].item(), replica[ZEROS_SLOT].item()) == (1, 0)


def test_inf_norm_combines_by_max():
    rows = torch.tensor([[2.0, 1.0, 0.0], [5.0, 2.0, 1.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    total = combine_contributions(rows, math.inf)
    assert total.tolist() == [5.0, 3.0, 1.0]
    assert combine_contributions(rows, 2.0).tolist() == [10.0, 3.0, 1.0]


def test_empty_tensors_add_nothing_and_no_tensors_is_refused():
    with pytest.raises(ValueError, match="at least one tensor"):
        shard_contribution([], norm_type=2.0, replication=1, canonical=True, count_zeros=False)
    for p in NORM_TYPES:  # empty tensors add nothing
        row = shard_contribution(
            [torch.zeros(0), torch.zeros(0, 3)],
            norm_type=p,
            replication=1,
            canonical=True,
            count_zeros=True,
        )
        assert row.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, -math.inf])
def test_norm_type_must_be_positive(bad):
    with pytest.raises(ValueError, match="norm_type"):
        check_norm_type(bad)
    with pytest.raises(TypeError, match="norm_type"):
        check_norm_type("two")


def test_layout_helper_round_trip_for_fsdp_over_tp():
    """The suite's own slicing of (_StridedShard(0, sf=2), Shard(0)) covers the tensor exactly."""
    from _layouts import GradSpec

    spec = GradSpec((8, 2), (2, 2), (0, 1), (PlacementSpec("SS", 0, 2), PlacementSpec("S", 0)))
    g = global_tensor(spec, ())
    pieces = [local_shard(g, spec, c) for c in itertools.product(range(2), range(2))]
    assert sorted(torch.cat(pieces).flatten().tolist()) == sorted(g.flatten().tolist())
