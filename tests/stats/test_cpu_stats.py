"""The CPU stats path (``_cpu_stats``) against a float64 brute force, in one process.

Buckets of float32, bfloat16 and float16 tensors with values drawn across the whole float32
range (near its max, subnormals, mixed huge and tiny tensors, empty tensors, zeros, NaN and
inf) must give the reference path's contribution: the norm slot to the suite's tolerance, the
zero and non-finite counts exactly, NaN/inf where float64 gives NaN/inf. Both ``host_reads``
modes must agree bit for bit (the wrapper's ``host_sync`` modes rely on it).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfsdp_optim.stats import _cpu
from mfsdp_optim.stats._math import (
    NONFINITE_SLOT,
    NORM_SLOT,
    ZEROS_SLOT,
    finish_norm,
    shard_contribution,
)

NORM_TYPES = [0.5, 2.0, 3.0, math.inf]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_MAX = torch.finfo(torch.float32).max
# the documented bound on the relative error of sum |x| ** p (``_cpu_stats``' docstring)
SLOT_RTOL = 256 * 2.0**-24

# magnitudes (float32 bit patterns' worth of range): subnormals, tiny, ordinary, huge, near max
SCALES = [1e-44, 1e-40, 1e-30, 1e-21, 1e-20, 1e-3, 1.0, 1e15, 1e20, 1e30, F32_MAX / 4]


@st.composite
def tensors_of(draw, dtype):
    """One tensor: a length (0, small, or past one piece), a magnitude, maybe zeros/NaN/inf."""
    n = draw(st.sampled_from([0, 1, 7, 300, 1025, 3 * 1024, 5 * 2048 + 256, 2 * _cpu.PIECE + 5]))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from(SCALES))
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    if n and draw(st.booleans()):
        t[torch.rand(n, generator=gen) < 0.3] = 0.0
    if n and draw(st.integers(0, 9)) == 0:
        t[draw(st.integers(0, n - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    t = torch.where(t.isfinite(), t.clamp(-F32_MAX, F32_MAX), t).to(dtype)
    if draw(st.booleans()) and n >= 4:
        t = t.view(-1, 2) if n % 2 == 0 else t  # a 2-D view now and then
    return t


def _brute(ts, p):
    """Float64 brute force over the concatenation: (``||.||_p ** p`` or max, zeros, nonfinite)."""
    v = torch.cat([t.reshape(-1).double() for t in ts])
    if math.isinf(p):
        slot = v.abs().max() if v.numel() else torch.tensor(0.0, dtype=torch.float64)
    else:
        slot = torch.linalg.vector_norm(v, p) ** p
    nonfinite = sum(int(not torch.isfinite(t.double()).all()) for t in ts if t.numel())
    return slot, int((v == 0).sum()), nonfinite


def _contrib(ts, p, host_reads):
    return shard_contribution(
        ts, norm_type=p, replication=1, canonical=True, count_zeros=True, host_reads=host_reads
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data(), p=st.sampled_from(NORM_TYPES), dtype=st.sampled_from(DTYPES))
def test_cpu_path_matches_float64_brute_force(data, p, dtype):
    ts = data.draw(st.lists(tensors_of(dtype), min_size=1, max_size=5))
    assert _cpu.applies(ts, p)
    row = _contrib(ts, p, host_reads=True)
    other = _contrib(ts, p, host_reads=False)
    torch.testing.assert_close(row, other, rtol=0.0, atol=0.0, equal_nan=True)  # bit for bit
    slot, zeros, nonfinite = _brute(ts, p)
    assert int(row[ZEROS_SLOT]) == zeros
    assert int(row[NONFINITE_SLOT]) == nonfinite
    got = row[NORM_SLOT]
    if not torch.isfinite(slot):
        assert torch.equal(got.isnan(), slot.isnan()) and torch.equal(got.isinf(), slot.isinf())
        return
    # the norm the user sees, to the suite's tolerance (tests/stats/test_stats_math.py)
    expected = slot if math.isinf(p) else slot ** (1.0 / p)
    torch.testing.assert_close(
        finish_norm(got, p).double(), expected.to(torch.float32).double(), rtol=1e-5, atol=1e-30
    )
    # the float64 slot itself, to the documented bound
    torch.testing.assert_close(got, slot, rtol=SLOT_RTOL, atol=0.0)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("value", [1e30, F32_MAX, 1e-21, 1e-30, 1e-45, 3e-39])
def test_huge_and_tiny_tensors_are_recomputed_in_float64(p, value):
    ts = [torch.full((4000,), value), torch.full((33,), value / 2), torch.empty(0)]
    row = _contrib(ts, p, host_reads=True)
    slot, _, _ = _brute(ts, p)
    assert row[NONFINITE_SLOT] == 0
    torch.testing.assert_close(row[NORM_SLOT], slot, rtol=SLOT_RTOL, atol=0.0)
    norm = finish_norm(row[NORM_SLOT], p).double()
    expected = slot if math.isinf(p) else slot ** (1.0 / p)
    if math.isfinite(expected.to(torch.float32)):
        torch.testing.assert_close(norm, expected.to(torch.float32).double(), rtol=1e-5, atol=1e-30)


def test_all_empty_bucket_adds_nothing():
    for p in NORM_TYPES:
        row = _contrib([torch.empty(0), torch.empty(0, 3)], p, host_reads=True)
        assert row.tolist() == [0.0, 0.0, 0.0]


def test_millions_of_elements_stay_accurate():
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(3_000_000, generator=gen)  # all positive: float32 running sums drift most
    for p in (2.0, 3.0, 0.5):
        row = _contrib([t], p, host_reads=True)
        slot = torch.linalg.vector_norm(t.double(), p) ** p
        torch.testing.assert_close(row[NORM_SLOT], slot, rtol=1e-6, atol=0.0)


def test_reference_path_keeps_other_dtypes_and_p1():
    assert not _cpu.applies([torch.ones(3)], 1.0)
    assert not _cpu.applies([torch.ones(3, dtype=torch.float64)], 2.0)
    assert not _cpu.applies([torch.ones(3, dtype=torch.int64)], 2.0)
    assert not _cpu.applies([torch.ones(3, device="meta")], 2.0)
    with pytest.raises(RuntimeError):  # an int64 grad still raises, as before
        _contrib([torch.ones(3, dtype=torch.int64)], 2.0, host_reads=True)
