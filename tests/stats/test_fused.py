"""The fused (Triton) stats kernel against the pure-torch reference.

CPU parts check that the dispatch stays out of the way where it does not apply. GPU parts compare
``_fused.shard_contribution`` with ``_stats_math.shard_contribution`` on many shapes, dtypes and
norm types, with planted zeros, NaN/inf, empty and unaligned tensors.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from mfsdp_optim.stats import _fused
from mfsdp_optim.stats._math import shard_contribution as reference

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

NORMS = [2.0, 1.0, 3.0, 0.5, math.inf, 1.5]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _kw(p, replication=1, canonical=True, count_zeros=True):
    return dict(norm_type=p, replication=replication, canonical=canonical, count_zeros=count_zeros)


# ----------------------------------------------------------------------------------------- CPU


def test_cpu_tensors_fall_back():
    ts = [torch.randn(5, 3), torch.zeros(4)]
    assert _fused.shard_contribution(ts, **_kw(2.0)) is None
    assert _fused.shard_contribution([], **_kw(2.0)) is None


def test_env_switch_disables(monkeypatch):
    monkeypatch.setenv("MFSDP_OPTIM_DISABLE_FUSED", "1")
    assert not _fused.fused_available()
    assert _fused.shard_contribution([torch.ones(3)], **_kw(2.0)) is None


def test_p_kind():
    assert _fused._p_kind(math.inf) == _fused._P_INF
    assert _fused._p_kind(2.0) == _fused._P_TWO
    assert _fused._p_kind(1) == _fused._P_ONE
    assert _fused._p_kind(0.5) == _fused._P_HALF
    assert _fused._p_kind(3.0) == _fused._P_THREE
    assert _fused._p_kind(2.5) == _fused._P_GENERAL


def test_package_imports_without_triton():
    """A CPU-only install (no triton) imports the package and reports the fused path off."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, mfsdp_optim\n"
        "from mfsdp_optim.stats import _fused\n"
        "assert _fused.shard_contribution([torch.ones(3)], norm_type=2.0, replication=1,"
        " canonical=True, count_zeros=True) is None\n"
        "assert not _fused._load_triton() if torch.cuda.is_available() else True\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


# ----------------------------------------------------------------------------------------- GPU


def _truth_nonfinite(ts):
    return sum(int((~torch.isfinite(t.float())).any()) for t in ts if t.numel() > 0)


def _check(ts, p, replication=1, canonical=True, count_zeros=True, rtol=1e-9):
    got = _fused.shard_contribution(ts, **_kw(p, replication, canonical, count_zeros))
    assert got is not None, "fused path did not apply"
    assert got.dtype == torch.float64 and got.shape == (3,) and got.device == ts[0].device
    nonempty = [t for t in ts if t.numel() > 0]
    want = reference(nonempty, **_kw(p, replication, canonical, count_zeros))
    got, want = got.cpu(), want.cpu()
    bad = _truth_nonfinite(ts)
    assert got[2].item() == bad
    assert got[1].item() == want[1].item()  # zero counts exact
    if bad:
        assert not math.isfinite(got[0].item())
    else:
        torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=0.0)
    return got


def _shapes(gen, k, max_numel):
    out = []
    for _ in range(k):
        r = torch.rand((), generator=gen).item()
        if r < 0.1:
            out.append((0,))
        elif r < 0.3:
            out.append((int(torch.randint(1, 64, (), generator=gen)),))
        elif r < 0.5:
            # around the item size: BLOCK-1, BLOCK, BLOCK+1 elements
            b = _fused._BLOCK
            out.append((b + int(torch.randint(-2, 3, (), generator=gen)),))
        else:
            n = int(torch.randint(1, max_numel, (), generator=gen))
            out.append((n,) if n % 7 else (7, n // 7))
    return out


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
def test_matches_reference_many_shapes(dtype, p):
    gen = torch.Generator().manual_seed(hash((str(dtype), p)) % 2**31)
    for trial in range(4):
        shapes = _shapes(gen, int(torch.randint(1, 40, (), generator=gen)), 300_000)
        if all(math.prod(s) == 0 for s in shapes):
            shapes.append((3,))
        ts = [(torch.randn(s, generator=gen) * 3).to(dtype).cuda() for s in shapes]
        for t in ts:  # planted zeros
            if t.numel():
                t.view(-1)[torch.rand(t.numel(), generator=gen).cuda() < 0.05] = 0
        rep, canon = [(1, True), (4, True), (2, False), (3, True)][trial]
        _check(ts, p, replication=rep, canonical=canon)
        _check(ts, p, replication=rep, canonical=canon, count_zeros=False)


@cuda
@pytest.mark.parametrize("p", NORMS)
def test_many_tensors_one_launch(p):
    gen = torch.Generator().manual_seed(7)
    ts = [torch.randn(int(torch.randint(1, 5000, (), generator=gen)), generator=gen).cuda()
          for _ in range(3000)]  # fmt: skip
    _check(ts, p)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [2.0, math.inf, 1.5])
def test_nan_inf_flag_per_tensor(dtype, p):
    gen = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=gen).to(dtype).cuda() for n in (10, 5000, 70000, 3, 2049)]
    ts[1][17] = float("nan")
    ts[2][-1] = float("inf")
    ts[2][5] = float("-inf")
    ts[4][2048] = float("nan")  # in the ragged last item
    got = _check(ts, p)
    assert got[2].item() == 3
    # the workspace flags are cleared by the kernel: a clean call sees none
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in ts]
    assert _check(clean, p)[2].item() == 0


@cuda
def test_nonfinite_inf_norm_propagates_nan():
    t = torch.ones(100_000, device="cuda")
    t[5000] = float("nan")
    got = _fused.shard_contribution([t], **_kw(math.inf))
    assert math.isnan(got[0].item()) and got[2].item() == 1


@cuda
def test_zero_count_exact_past_2_24():
    big = torch.zeros(2**24 + 77, device="cuda")
    big[::1000] = 1.0
    other = torch.zeros(3, 5, device="cuda", dtype=torch.float32)
    want = (big == 0).sum().item() + 15
    got = _check([big, other], 2.0)
    assert got[1].item() == want
    assert _fused.shard_contribution([big, other], **_kw(2.0, canonical=False))[1].item() == 0


@cuda
def test_large_values_do_not_overflow():
    t = torch.full((10_000,), 1e30, device="cuda")
    got = _check([t], 2.0, rtol=1e-12)
    assert math.isfinite(got[0].item()) and got[2].item() == 0
    got = _check([t.to(torch.bfloat16)], 3.0, rtol=1e-12)
    assert got[2].item() == 0


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_and_strided(dtype):
    gen = torch.Generator().manual_seed(11)
    flat = torch.randn(1_000_003, generator=gen).to(dtype).cuda()
    ts = [flat[1:5001], flat[5003:300_000], flat[300_001:]]  # not 16-byte aligned
    _check(ts, 2.0)
    _check(ts, math.inf)
    m = torch.randn(300, 257, generator=gen).to(dtype).cuda()
    mixed = [m.t(), flat[1:9], m[:, ::2], torch.randn(40, generator=gen).to(dtype).cuda()]
    _check(mixed, 2.0)
    _check(mixed, 1.0)


@cuda
def test_deterministic_and_cache_follows_values():
    ts = [torch.randn(3000 + i, device="cuda") for i in range(50)]
    a = _fused.shard_contribution(ts, **_kw(2.0))
    b = _fused.shard_contribution(ts, **_kw(2.0))
    assert torch.equal(a, b)
    ts[7].mul_(2.0)  # same addresses, new values: the cached table must not stale the result
    _check(ts, 2.0)
    old = _fused.TABLE_CACHE_ENABLED
    try:
        _fused.TABLE_CACHE_ENABLED = False
        c = _check(ts, 2.0)
    finally:
        _fused.TABLE_CACHE_ENABLED = old
    assert torch.equal(c, _fused.shard_contribution(ts, **_kw(2.0)).cpu())


@cuda
def test_side_stream_and_other_device_index():
    ts = [torch.randn(10_000, device="cuda") for _ in range(5)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _fused.shard_contribution(ts, **_kw(2.0))
    torch.cuda.current_stream().wait_stream(s)
    want = reference(ts, **_kw(2.0))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)


@cuda
def test_graph_capture_needs_a_table_made_outside_it():
    """Under CUDA graph capture the kernel launches only where an eager call on the capturing
    stream made its table and workspace (a capture uploads and allocates nothing outside the
    graph: the captured step's warm-up); elsewhere the caller's pure-torch path runs. The
    replayed launch follows the tensors' new values."""
    _fused._table_cache.clear()  # no table of an earlier test on a recycled stream handle
    ts = [torch.randn(1000, device="cuda")]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
            assert _fused.shard_contribution(ts, **_kw(2.0)) is None
        want = _fused.shard_contribution(ts, **_kw(2.0))  # eager on s: its table, workspace
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            got = _fused.shard_contribution(ts, **_kw(2.0))
    assert got is not None
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    ts[0].mul_(3.0)
    g.replay()
    torch.testing.assert_close(got, reference(ts, **_kw(2.0)), rtol=1e-9, atol=0)


@cuda
def test_stats_layer_uses_fused_bucket_path():
    from mfsdp_optim.stats import _contribution

    ts = [torch.randn(100 + i, device="cuda") for i in range(20)]
    buckets = {
        (ts[0].device, torch.float32, 2, True): ts[:10],
        (ts[0].device, torch.float32, 1, False): ts[10:],
    }
    got = _contribution.local_contribution([buckets], 2.0, True, ts[0].device)
    a = reference(ts[:10], **_kw(2.0, 2, True))
    b = reference(ts[10:], **_kw(2.0, 1, False))
    torch.testing.assert_close(got[:3], (a + b)[:3], rtol=1e-9, atol=0)


@cuda
def test_persistent_table_follows_moved_tensors():
    """The kept table is re-pointed when the tensors move (only the offsets re-uploaded) and
    reused when they do not; results stay right either way."""
    ts = [torch.randn(500 + (i % 7), device="cuda") for i in range(3000)]
    _check(ts, 2.0)
    numels = tuple(t.numel() for t in ts)
    stream = torch.cuda.current_stream().cuda_stream
    tab = _fused._table_cache[(ts[0].device.index, stream, ts[0].dtype, numels)]
    uploads = tab.table.uploads
    _check(ts, 2.0)
    assert tab.table.uploads == uploads
    old = ts
    ts = [t * 2 for t in ts]  # new tensors at new addresses (old ones still alive)
    _check(ts, 2.0)
    _check(ts, math.inf)
    assert _fused._table_cache[(ts[0].device.index, stream, ts[0].dtype, numels)] is tab
    assert tab.table.uploads == uploads + 2  # the offsets, then the norm type
    del old
