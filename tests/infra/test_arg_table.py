"""The persistent kernel argument tables (``_infra.device_table``, ``_fused.StatsTable``,
``_triton_adam.AdamTable``) on CPU tensors: their contents, when they are rebuilt or patched,
and the holder logic of ``TritonAdam``; no kernel is launched (except under Triton's
interpreter, ``TRITON_INTERPRET=1``, see the last tests)."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from mfsdp_optim._infra import device_table
from mfsdp_optim.optim._engines import _triton_adam
from mfsdp_optim.optim._engines._triton_adam import AdamTable, TritonAdam
from mfsdp_optim.stats import _fused

GROUP = dict(
    lr=1e-2,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.1,
    amsgrad=False,
    maximize=False,
    decoupled_weight_decay=True,
)
SHAPES = [(40, 3), (0, 8), (5,), (2048,), (3, 1025), (1,)]


def _elem_offsets(ts, keep):
    base = ts[keep[0]].data_ptr()
    return [(ts[i].data_ptr() - base) // ts[i].element_size() for i in keep]


def _lists(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)

    def make():
        return [torch.randn(s, generator=gen) for s in shapes]

    p, g, m, v = make(), make(), make(), [x.abs() for x in make()]
    steps = [torch.tensor(1.0) for _ in shapes]
    return p, g, m, v, steps


def _odd_pair():
    """Two float32 tensors of 2 elements, 10 bytes apart (a shared host buffer, kept alive by
    the tensors)."""
    buf = bytearray(64)
    return [torch.frombuffer(buf, dtype=torch.float32, count=2, offset=o) for o in (0, 10)]


def _realloc(ts):
    """Copies at new addresses (the originals are returned too, to keep them alive)."""
    return [t.clone() for t in ts], ts


# ------------------------------------------------------------------------------ the check


def test_same_addresses():
    ts = [torch.empty(4), torch.empty(3), torch.empty(0)]
    ptrs = device_table.addresses(ts)
    assert ptrs == [t.data_ptr() for t in ts]
    assert device_table.same_addresses(ts, ptrs)
    assert device_table.same_addresses(ts, ptrs, [0, 2])
    assert not device_table.same_addresses(ts[:2], ptrs)  # lengths differ
    moved = [ts[0], torch.empty(3), ts[2]]
    assert not device_table.same_addresses(moved, ptrs)
    assert device_table.same_addresses(moved, ptrs, [0, 2])  # the moved one is not asked about
    assert not device_table.same_addresses(moved, ptrs, [1])


def test_device_table_patches_only_changes():
    host = np.arange(10, dtype=np.int64)
    tab = device_table.DeviceTable(host, torch.device("cpu"))
    assert tab.uploads == 1 and tab.tensor.tolist() == list(range(10))
    assert not tab.patch(2, np.array([2, 3], dtype=np.int64))
    assert tab.uploads == 1
    assert tab.patch(2, np.array([7, 8], dtype=np.int64))
    assert tab.uploads == 2
    assert tab.tensor.tolist() == [0, 1, 7, 8, 4, 5, 6, 7, 8, 9]
    assert tab.host.tolist() == tab.tensor.tolist()


def test_check_all_env(monkeypatch):
    monkeypatch.delenv(device_table.CHECK_ALL_ENV, raising=False)
    assert not device_table.check_all_lists()
    monkeypatch.setenv(device_table.CHECK_ALL_ENV, "1")
    assert device_table.check_all_lists()


# ------------------------------------------------------------------------------ stats table


def test_stats_table_contents_and_patches():
    ts = [torch.randn(n) for n in (3000, 0, 5, 2048, 7)]
    numels = [t.numel() for t in ts]
    tab = _fused.StatsTable.build(numels, 2.0)
    assert tab is not None and tab.n == 4 and tab.keep == [0, 2, 3, 4] and tab.first == 0
    assert tab.refresh(ts, 2.0)
    n, host = tab.n, tab.table.tensor.tolist()
    assert host[:n] == _elem_offsets(ts, tab.keep)
    assert host[n : 2 * n] == [3000, 5, 2048, 7]
    assert host[2 * n : 3 * n + 1] == [0, 2, 3, 4, 5]
    assert tab.total_items == 5
    assert np.array([host[3 * n + 1]]).view(np.float64)[0] == 2.0
    uploads = tab.table.uploads
    assert tab.refresh(ts, 2.0) and tab.table.uploads == uploads  # nothing moved
    moved, _keep_alive = _realloc(ts)
    assert tab.refresh(moved, 2.0)
    assert tab.table.uploads == uploads + 1  # only the offsets
    assert tab.table.tensor.tolist()[:n] == _elem_offsets(moved, tab.keep)
    assert tab.table.tensor.tolist()[n:] == host[n:]
    assert tab.refresh(moved, float("inf")) and tab.table.uploads == uploads + 2
    assert tab.table.tensor.tolist()[3 * n + 1] == 0


def test_stats_table_all_empty_and_odd_offsets():
    assert _fused.StatsTable.build([0, 0], 2.0) is None
    # a float32 tensor 10 bytes after the first: not a whole number of elements away
    mixed = _odd_pair()
    tab = _fused.StatsTable.build([2, 2], 2.0)
    assert tab is not None and not tab.refresh(mixed, 2.0)


def test_stats_table_cache_follows_layout_and_addresses(monkeypatch):
    monkeypatch.setattr(_fused, "_table_cache", type(_fused._table_cache)())
    dev = torch.device("cpu")
    ts = [torch.randn(100 + i) for i in range(30)]
    a = _fused._stats_table(ts, 2.0, dev, 0)
    assert _fused._stats_table(ts, 2.0, dev, 0) is a  # the same layout: the same table
    assert a.table.uploads == 1
    moved, _keep_alive = _realloc(ts)
    assert _fused._stats_table(moved, 2.0, dev, 0) is a and a.table.uploads == 2
    other = [torch.randn(99 + i) for i in range(30)]  # another layout: its own table
    b = _fused._stats_table(other, 2.0, dev, 0)
    assert b is not a and len(_fused._table_cache) == 2
    assert _fused._stats_table(moved, 2.0, dev, 7) is not a  # another stream
    halves = [t.to(torch.bfloat16) for t in moved]  # same numels, another element size
    assert _fused._stats_table(halves, 2.0, dev, 0) is not a
    monkeypatch.setattr(_fused, "TABLE_CACHE_ENABLED", False)
    assert _fused._stats_table(moved, 2.0, dev, 0) is not a


# ------------------------------------------------------------------------------ Adam table


def test_adam_table_contents():
    p, g, m, v, s = _lists()
    tab = AdamTable.build(p, m, v, s, GROUP, 0)
    assert tab is not None and tab.table is None  # the device copy comes with the grads
    assert tab.refresh_grads(g)
    keep = [0, 2, 3, 4, 5]
    n = len(keep)
    assert tab.keep == keep and tab.n == n
    t = tab.table.tensor.tolist()
    assert t[0:n] == _elem_offsets(p, keep)
    assert t[n : 2 * n] == _elem_offsets(m, keep)
    assert t[2 * n : 3 * n] == _elem_offsets(v, keep)
    assert t[3 * n : 4 * n] == keep
    assert t[4 * n : 5 * n] == [120, 5, 2048, 3075, 1]
    assert t[5 * n : 6 * n + 1] == [0, 1, 2, 3, 5, 6]  # cum items of 2048 elements
    assert t[tab.goff_at : tab.goff_at + n] == _elem_offsets(g, keep)
    assert t[tab.goff_at + n : tab.hp_at] == _elem_offsets(s, list(range(len(s))))
    hp = np.array(t[tab.hp_at :], dtype=np.int64).view(np.float64).tolist()
    assert hp == [1e-2, 0.9, 0.999, 1e-8, 0.1]
    assert tab.total_items == 6 and tab.n_steps == len(s)


def test_adam_table_refresh_uploads_only_what_moved():
    p, g, m, v, s = _lists()
    tab = AdamTable.build(p, m, v, s, GROUP, 0)
    assert tab.refresh_grads(g)
    before = tab.table.tensor.clone()
    assert tab.table.uploads == 1
    assert tab.refresh_grads(g) and tab.table.uploads == 1  # same grads
    again = [x.view_as(x) for x in g]  # new tensor objects, same addresses
    assert tab.refresh_grads(again) and tab.table.uploads == 1
    moved, _keep_alive = _realloc(g)
    assert tab.refresh_grads(moved) and tab.table.uploads == 2
    after = tab.table.tensor
    assert after[tab.goff_at : tab.goff_at + tab.n].tolist() == _elem_offsets(moved, tab.keep)
    rest = torch.ones_like(after, dtype=torch.bool)
    rest[tab.goff_at : tab.goff_at + tab.n] = False
    assert torch.equal(after[rest], before[rest])
    tab.refresh_hparams(GROUP)
    assert tab.table.uploads == 2
    tab.refresh_hparams(dict(GROUP, lr=5e-3))  # an lr schedule
    assert tab.table.uploads == 3
    assert np.array(after[tab.hp_at :].tolist()).view(np.float64)[0] == 5e-3


def test_adam_table_fits_lists_and_holds_storages(monkeypatch):
    monkeypatch.delenv(device_table.CHECK_ALL_ENV, raising=False)
    p, g, m, v, s = _lists()
    tab = AdamTable.build(p, m, v, s, GROUP, 0)
    assert tab.fits(p, m, v, s)
    assert not tab.fits(list(p), m, v, s)  # another list object: another cache
    storage = p[0].untyped_storage()
    p[0].data = torch.randn(40, 3)  # a storage swapped under a held tensor
    assert tab.fits(p, m, v, s)  # not seen by default ...
    assert any(st.data_ptr() == storage.data_ptr() for st in tab.storages)  # ... old one held
    monkeypatch.setenv(device_table.CHECK_ALL_ENV, "1")
    assert not tab.fits(p, m, v, s)  # seen with every list checked


def test_adam_table_all_empty_and_misaligned():
    p, g, m, v, s = _lists(shapes=[(0,), (0, 3)])
    tab = AdamTable.build(p, m, v, s, GROUP, 0)
    assert tab is not None and tab.n == 0
    p = _odd_pair()
    _, _, m, v, s = _lists(shapes=[(2,), (2,)])
    assert AdamTable.build(p, m, v, s, GROUP, 0) is None


# ------------------------------------------------------------------------------ holder logic


class _Holder:
    triton_table = None


def _kept(tri, holder, p, g, m, v, s, group=GROUP, grad_dtype=None):
    return tri._kept(holder, group, p, g, m, v, s, grad_dtype)


def test_holder_keeps_one_table_across_steps():
    tri, holder = TritonAdam(), _Holder()
    p, g, m, v, s = _lists()
    tab = _kept(tri, holder, p, g, m, v, s)
    assert tab is holder.triton_table and tri.builds == 1
    for _ in range(3):  # steady state: grads re-created at new addresses every step
        g, _old = _realloc(g)
        assert _kept(tri, holder, p, g, m, v, s) is tab
    assert tri.builds == 1 and tab.table.uploads == 4
    assert _kept(tri, _Holder(), p, g, m, v, s) is not tab and tri.builds == 2  # a new cache
    m2 = list(m)  # the fast step rebuilt its lists (e.g. after load_state_dict)
    tab2 = _kept(tri, holder, p, g, m2, v, s)
    assert tab2 is not tab and holder.triton_table is tab2 and tri.builds == 3


def test_holder_declines_and_remembers():
    tri, holder = TritonAdam(), _Holder()
    p, g, m, v, s = _lists(shapes=[(4, 6), (5,)])
    m = [m[0].t(), m[1]]  # a non-contiguous state tensor: these lists cannot be taken
    assert _kept(tri, holder, p, g, m, v, s) is None
    assert holder.triton_table is _triton_adam._DECLINED and tri.builds == 0
    assert _kept(tri, holder, p, g, m, v, s) is None and tri.builds == 0


def test_holder_checks_grads_every_step():
    tri, holder = TritonAdam(), _Holder()
    p, g, m, v, s = _lists(shapes=[(4, 6), (5,)])
    assert _kept(tri, holder, p, g, m, v, s) is not None
    assert _kept(tri, holder, p, [g[0].t(), g[1]], m, v, s) is None  # strided grad
    assert _kept(tri, holder, p, [x.double() for x in g], m, v, s) is None  # other dtype
    assert _kept(tri, holder, p, g, m, v, s, grad_dtype=torch.bfloat16) is None  # vouched
    assert _kept(tri, holder, p, g, m, v, s, grad_dtype=torch.float32) is not None
    assert tri.builds == 1


def test_one_off_keeps_the_size_rule(monkeypatch):
    tri = TritonAdam()
    p, g, m, v, s = _lists()
    assert tri._one_off(GROUP, p, g, m, v, s, None) is None  # small tensors, no holder
    monkeypatch.setattr(_triton_adam, "_MIN_MEAN_NUMEL", 0)
    tab = tri._one_off(GROUP, p, g, m, v, s, None)
    assert tab is not None and tab.table is not None and tri.builds == 1


# ------------------------------------------------------------------------------ fast step


def _rank_fast_step_holder():
    """The fast step hands its group cache as the holder when the lists are whole, None when
    some params have no grad; a rebuilt cache (load_state_dict) comes with an empty slot."""
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((1,))
    params = [
        torch.nn.Parameter(DTensor.from_local(torch.randn(8, 4), mesh, [Shard(0)]))
        for _ in range(3)
    ]
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True),
        OptimizerConfig(clip_grad=1.0, triton_adam_step=True),
    )
    seen = []

    def record(
        group, params_, grads, m, v, s, divisor, holder=None, grad_dtype=None, found_inf=None
    ):
        seen.append((holder, len(grads), grad_dtype))
        return False  # torch's kernel runs

    opt._engines[0].triton = types.SimpleNamespace(step=record, launches=0)

    def grads(which):
        for i, p in enumerate(params):
            p.grad = DTensor.from_local(torch.randn(8, 4), mesh, [Shard(0)]) if i in which else None

    for which in ((0, 1, 2), (0, 1, 2), (0, 2), (0, 1, 2)):
        grads(which)
        opt.step()
        opt.zero_grad()
    first_cache = seen[0][0]
    opt.load_state_dict(opt.state_dict())
    grads((0, 1, 2))
    opt.step()
    return [
        (h is not None, n, str(d), h is first_cache, getattr(h, "triton_table", "x"))
        for h, n, d in seen
    ]


def test_fast_step_hands_its_cache(ranks):
    (seen,) = ranks(1).run(_rank_fast_step_holder)
    # step 1 creates the state on the generic path; then whole, filtered, whole, reloaded
    assert [s[:4] for s in seen] == [
        (True, 3, "torch.float32", True),
        (False, 2, "torch.float32", False),
        (True, 3, "torch.float32", True),
        (True, 3, "torch.float32", False),
    ]
    assert all(s[4] is None for s in seen if s[0])


# ------------------------------------------------------------------------------ interpreter

interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (TRITON_INTERPRET=1)"
)


# the construct the kernels loop with (a range whose bounds are run-time values), alone: Triton
# 3.6's interpreter turns a bound into a Python int with int() of a one-element array, which
# NumPy 2.4 and later refuse
_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def k(out, n):
    acc = 0
    for i in range(tl.program_id(0), n):
        acc += i
    tl.store(out, acc)

out = torch.zeros(1, dtype=torch.int32)
k[(1,)](out, 4)
assert out.item() == 6, out
"""


@pytest.mark.timeout(600)
def test_the_kernels_under_tritons_interpreter_in_a_process_of_their_own():
    """The ``interpret`` tests below, wherever Triton is installed (CI's trainers extra): Triton
    reads TRITON_INTERPRET when it is imported, so they run in a pytest process of their own
    with it set. They check the kernels' addressing and arithmetic on CPU tensors, the only
    run of the kernels a machine without a GPU gets."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process is the interpreter's run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    probe = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        assert "only 0-dimensional arrays" in probe.stderr, probe.stderr[-2000:]
        pytest.skip(
            "this Triton's interpreter cannot loop over a run-time range with this NumPy (Triton "
            "3.6 with NumPy 2.4 and later, as on the GPU image): the kernels' interpreter runs "
            "need a later Triton (CI's trainers extra pins 3.9.0)"
        )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += [__file__, "-k", "interpreted"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout


@pytest.fixture
def interpreted_adam(monkeypatch):
    """The Adam kernel under Triton's interpreter, which lacks libdevice's pow/div_rn/sqrt_rn:
    they are replaced by ``tl`` equivalents, so this checks the addressing, not the rounding."""
    pytest.importorskip("triton")
    import triton.language as tl

    kernel = _triton_adam._load()
    assert kernel is not None
    shim = types.SimpleNamespace(
        pow=lambda a, b, **kw: tl.exp(b * tl.log(a)),
        sqrt_rn=lambda x, **kw: tl.sqrt_rn(x),
        div_rn=lambda a, b, **kw: tl.div_rn(a, b),
    )
    monkeypatch.setattr(_triton_adam, "libdevice", shim, raising=False)
    return kernel


def _torch_adamw(p, g, m, v, s, divisor):
    torch._foreach_add_(s, 1)
    torch._fused_adamw_(
        p,
        [x.clone() for x in g],
        m,
        v,
        [],
        s,
        amsgrad=False,
        lr=GROUP["lr"],
        beta1=0.9,
        beta2=0.999,
        weight_decay=GROUP["weight_decay"],
        eps=GROUP["eps"],
        maximize=False,
        grad_scale=divisor,
        found_inf=None,
    )


@interpret
@pytest.mark.parametrize(
    "shapes, programs",
    [
        ([(7, 3)] * 200 + [(0,), (4097,), (2048,)], None),
        # 3 items a tensor, 4 items a program: programs start inside a tensor and cross into
        # the next (the per-tensor scalars re-read where a run of items enters a tensor)
        ([(5000,)] * 7 + [(7, 3)] * 5, 7),
    ],
)
def test_interpreted_adam_with_moving_grads(interpreted_adam, shapes, programs, monkeypatch):
    if programs is not None:
        monkeypatch.setattr(_triton_adam, "_PROGRAMS_PER_SM", programs)
    tri, holder = TritonAdam(), _Holder()
    p, g, m, v, s = _lists(1, shapes)
    ref = [[x.clone() for x in xs] for xs in (p, m, v, s)]
    divisor = torch.tensor(2.5)
    for step in range(3):
        tab = _kept(tri, holder, p, g, m, v, s)
        tri._launch(interpreted_adam, tab, g, GROUP, divisor)
        _torch_adamw(ref[0], g, ref[1], ref[2], ref[3], divisor)
        g = [x * 0.5 + 1e-3 * step for x in g]  # new grads at new addresses
    assert tri.builds == 1 and tab.table.uploads == 3
    for a, b in zip(p, ref[0], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(s, ref[3], strict=True))


@interpret
def test_interpreted_stats_with_moving_grads():
    pytest.importorskip("triton")
    from mfsdp_optim.stats._math import shard_contribution as reference

    kernel = _fused._load_triton()
    assert kernel is not None
    ts = [torch.randn(n) for n in (3000, 0, 5, 2048, 7)]
    tab = _fused.StatsTable.build([t.numel() for t in ts], 2.0)
    for _ in range(2):
        assert tab.refresh(ts, 2.0)
        ws = {k: torch.zeros(64, dtype=d) for k, d in (("psum", torch.float64), ("z", torch.int64))}
        flags, ticket = torch.zeros(64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        out = torch.zeros(3, dtype=torch.float64)
        per = -(-tab.total_items // 2)
        kernel[(2,)](
            ts[tab.first], tab.table.tensor, tab.n, tab.total_items, per, 2, ws["psum"],
            ws["z"], flags, ticket, out, 1, BLOCK=_fused._BLOCK, P_KIND=_fused._P_TWO,
            COUNT_ZEROS=True, ALIGN=1, REDUCE_BLOCK=_fused._REDUCE_BLOCK, FOLD=_fused._FOLD,
        )  # fmt: skip
        # in float64 (the CPU path of float32 sums float32 partials: 1e-8 off the kernel)
        wide = [t.double() for t in ts]
        want = reference(wide, norm_type=2.0, replication=1, canonical=True, count_zeros=True)
        torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-9, atol=0)
        ts = [t.clone() for t in ts]  # moved
    assert tab.table.uploads == 2
