"""The Triton Adam/AdamW step (``OptimizerConfig(triton_adam_step=True)``, the default), on CUDA.

References: torch's own fused kernel (``torch._fused_adam_``/``_fused_adamw_``) on copies of the
same tensors, with the same clip divisor passed as its ``grad_scale``, and an independent float64
evaluation of the Adam update. The two float32 kernels round differently (FMA contraction,
float32 vs float64 bias corrections), so where the update is ill-conditioned (tiny second
moments) they agree only to a few hundred ulps; the float64 reference then decides that the
Triton kernel is at least as accurate as torch's. Step counters must match exactly and the grads
must be left untouched. Skipped without a CUDA device (the CI
machine has none); run on the device machine, see benchmarks/RESULTS.md.
"""

from __future__ import annotations

import itertools

import pytest
import torch

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)

SHAPES = [(1000, 33), (0, 8), (5,), (2048,), (3, 1025), (1,), (4097,)]


def _lists(dtype, seed, shapes=SHAPES, offset=0):
    gen = torch.Generator().manual_seed(seed)

    def make(scale=1.0, positive=False):
        out = []
        for s in shapes:
            numel = 1
            for d in s:
                numel *= d
            flat = torch.randn(numel + offset, generator=gen) * scale
            if positive:
                flat = flat.abs()
            out.append(flat.to("cuda", dtype)[offset:].view(s))
        return out

    params, grads = make(), make(3.0)
    m, v = make(0.1), make(0.01, positive=True)
    steps = [torch.tensor(float(seed % 5), device="cuda") for _ in shapes]
    return params, grads, m, v, steps


def _clone(xs):
    return [x.clone() for x in xs]


def _group(adamw, maximize, wd):
    return dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=wd,
        amsgrad=False,
        maximize=maximize,
        decoupled_weight_decay=adamw,
    )


def _adam_fp64(group, p, g, m, v, step, divisor):
    """One Adam/AdamW step in float64 on copies; returns the new param."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    beta1, beta2 = group["betas"]
    if divisor is not None:
        g = g / float(divisor)
    if group["maximize"]:
        g = -g
    if group["decoupled_weight_decay"]:
        p = p * (1 - group["lr"] * group["weight_decay"])
    else:
        g = g + group["weight_decay"] * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    return p - group["lr"] / bc1 * m / (v.sqrt() / bc2**0.5 + group["eps"])


@pytest.fixture(autouse=True)
def _small_tensors_too(monkeypatch):
    """The kernel declines groups of small tensors (host cost); these tests use small ones."""
    from mfsdp_optim.optim._engines import _triton_adam

    monkeypatch.setattr(_triton_adam, "_MIN_MEAN_NUMEL", 0)


CASES = list(
    itertools.product(
        (torch.float32, torch.bfloat16), (True, False), (False, True), (0.0, 0.1), (False, True)
    )
)


@cuda
@pytest.mark.parametrize("dtype,adamw,maximize,wd,with_divisor", CASES)
def test_matches_torch_fused(dtype, adamw, maximize, wd, with_divisor):
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    tri = TritonAdam()
    group = _group(adamw, maximize, wd)
    p, g, m, v, s = _lists(dtype, 1)
    rp, rg, rm, rv, rs = _clone(p), _clone(g), _clone(m), _clone(v), _clone(s)
    g_before = _clone(g)
    fn = torch._fused_adamw_ if adamw else torch._fused_adam_

    def torch_step(divisor):
        torch._foreach_add_(rs, 1)
        fn(
            rp,
            _clone(rg),
            rm,
            rv,
            [],
            rs,
            amsgrad=False,
            lr=group["lr"],
            beta1=0.9,
            beta2=0.999,
            weight_decay=wd,
            eps=1e-8,
            maximize=maximize,
            grad_scale=divisor,
            found_inf=None,
        )

    for step in range(3):
        divisor = torch.tensor(2.5 + step, device="cuda") if with_divisor else None
        assert tri.step(group, p, g, m, v, s, divisor)
        torch_step(divisor)
    tol = dict(rtol=5e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for i in range(len(SHAPES)):
        torch.testing.assert_close(p[i], rp[i], **tol, msg=lambda x, i=i: f"param {i}: {x}")
        torch.testing.assert_close(m[i], rm[i], **tol, msg=lambda x, i=i: f"exp_avg {i}: {x}")
        torch.testing.assert_close(v[i], rv[i], **tol, msg=lambda x, i=i: f"exp_avg_sq {i}: {x}")
        assert torch.equal(g[i], g_before[i]), "grads must not be written"
        assert torch.equal(s[i], rs[i]), "step counters"
    if dtype != torch.float32:
        return
    # One more step from identical inputs: each kernel's error against float64.
    for dst, src in ((rp, p), (rm, m), (rv, v)):
        torch._foreach_copy_(dst, src)
    divisor = torch.tensor(7.0, device="cuda") if with_divisor else None
    ref = [
        _adam_fp64(group, p[i], g[i], m[i], v[i], float(s[i]) + 1, divisor)
        for i in range(len(SHAPES))
    ]
    assert tri.step(group, p, g, m, v, s, divisor)
    torch_step(divisor)
    for i in range(len(SHAPES)):
        if not p[i].numel():
            continue
        err_tri = (p[i].double() - ref[i]).abs().max().item()
        err_torch = (rp[i].double() - ref[i]).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * ref[i].abs().max().item()
        assert err_tri <= 2 * err_torch + 4 * ulp, (i, err_tri, err_torch)


@cuda
@pytest.mark.parametrize("shapes", [SHAPES, [(0, 8), (0,)]], ids=["tensors", "all-empty"])
def test_found_inf_gates_the_update(shapes):
    """``found_inf`` = 1 (read by the kernel, as torch's): params, moments and step counters
    stay bit for bit; = 0: bit for bit what the call without it does. Also on a rank whose
    shards are all empty (only the counters move)."""
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    tri = TritonAdam()
    group = _group(True, False, 0.1)
    lists = _lists(torch.float32, 2, shapes)
    twin = [_clone(xs) for xs in lists]
    before = [_clone(xs) for xs in lists]
    divisor = torch.tensor(2.0, device="cuda")
    assert tri.step(group, *lists, divisor, found_inf=torch.ones((), device="cuda"))
    for name, xs, was in zip(
        ("param", "grad", "exp_avg", "exp_avg_sq", "step"), lists, before, strict=True
    ):
        assert all(torch.equal(a, b) for a, b in zip(xs, was, strict=True)), (
            f"{name} changed by a skipped update"
        )
    assert tri.step(group, *lists, divisor, found_inf=torch.zeros((), device="cuda"))
    assert tri.step(group, *twin, divisor)
    for name, xs, ys in zip(
        ("param", "grad", "exp_avg", "exp_avg_sq", "step"), lists, twin, strict=True
    ):
        assert all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True)), (
            f"{name}: found_inf=0 differs from no gate"
        )
    assert all(float(s) == float(b) + 1 for s, b in zip(lists[4], before[4], strict=True))


@cuda
def test_misaligned_and_many_tensors():
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    tri = TritonAdam()
    group = _group(True, False, 0.1)
    shapes = [(7, 3)] * 3000 + [(513,)] * 20
    p, g, m, v, s = _lists(torch.float32, 2, shapes, offset=1)  # 4-byte misaligned storage
    rp, rm, rv, rs = _clone(p), _clone(m), _clone(v), _clone(s)
    assert tri.step(group, p, g, m, v, s, None)
    torch._foreach_add_(rs, 1)
    torch._fused_adamw_(
        rp,
        _clone(g),
        rm,
        rv,
        [],
        rs,
        amsgrad=False,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.1,
        eps=1e-8,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )
    torch.testing.assert_close(
        torch.cat([x.flatten() for x in p]),
        torch.cat([x.flatten() for x in rp]),
        rtol=1e-5,
        atol=1e-6,
    )
    assert all(torch.equal(a, b) for a, b in zip(s, rs, strict=True))


@cuda
def test_declines_what_it_does_not_take():
    from mfsdp_optim.optim._engines._triton_adam import TritonAdam

    tri = TritonAdam()
    p, g, m, v, s = _lists(torch.float32, 3)
    group = _group(True, False, 0.0)
    assert not tri.step(dict(group, amsgrad=True), p, g, m, v, s, None)
    assert not tri.step(dict(group, lr=torch.tensor(0.01)), p, g, m, v, s, None)
    g_t = [x.t() if x.dim() == 2 else x for x in g]  # non-contiguous grads
    assert not tri.step(group, p, g_t, m, v, s, None)
    cpu = [x.cpu() for x in p]
    assert not tri.step(
        group,
        cpu,
        [x.cpu() for x in g],
        [x.cpu() for x in m],
        [x.cpu() for x in v],
        [x.cpu() for x in s],
        None,
    )
    assert tri.launches == 0


def _rank_wrapper(triton: bool):
    """4 clipped AdamW steps through the wrapper on a CUDA mesh vs torch's clip + fused step."""
    from mfsdp_optim.optim._engines import _triton_adam

    old_min = _triton_adam._MIN_MEAN_NUMEL
    _triton_adam._MIN_MEAN_NUMEL = 0  # small test tensors
    try:
        return _wrapper_run(triton)
    finally:
        _triton_adam._MIN_MEAN_NUMEL = old_min


def _wrapper_pair(shapes, triton: bool | None):
    """(mesh, DTensor params, plain reference params, wrapper over fused AdamW, reference
    fused AdamW) on one CUDA rank, from the same seeded values; ``triton`` None: the default
    config."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = init_device_mesh("cuda", (1,))
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).cuda() for s in shapes]
    params = [
        torch.nn.Parameter(DTensor.from_local(t.clone(), mesh, [Shard(0)], run_check=False))
        for t in init
    ]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    kw = dict(lr=1e-2, weight_decay=0.1, fused=True)
    flag = {} if triton is None else {"triton_adam_step": triton}
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(params, **kw), OptimizerConfig(clip_grad=0.5, **flag)
    )
    return mesh, params, ref, opt, torch.optim.AdamW(ref, **kw)


def _clipped_step_both(mesh, shapes, step, params, ref, opt, ref_opt):
    """One step of both on the same fresh grads (the wrapper's norm checked against torch's
    clip_grad_norm_); returns the grads, before zeroing them."""
    from torch.distributed.tensor import DTensor, Shard

    g_gen = torch.Generator().manual_seed(10 + step)
    grads = [torch.randn(s, generator=g_gen).cuda() for s in shapes]
    for p, q, g in zip(params, ref, grads, strict=True):
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
        q.grad = g.clone()
    ok, norm, _ = opt.step()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref, 0.5))
    ref_opt.step()
    assert ok and abs(norm - ref_norm) <= 1e-5 * ref_norm
    return grads


def _wrapper_run(triton: bool | None):
    mesh, params, ref, opt, ref_opt = _wrapper_pair(SHAPES, triton)
    for step in range(4):
        grads = _clipped_step_both(mesh, SHAPES, step, params, ref, opt, ref_opt)
        if triton is not False and step > 0:  # the first step creates the state on the generic path
            for p, g in zip(params, grads, strict=True):
                assert torch.equal(p.grad._local_tensor, g), "grads stay unclipped"
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p._local_tensor, q.detach(), rtol=1e-5, atol=1e-6)
        st, rst = opt.optimizer.state[p], ref_opt.state[q]  # stock state: DTensor values
        for k in rst:
            mine = st[k]._local_tensor if hasattr(st[k], "_local_tensor") else st[k]
            torch.testing.assert_close(mine, rst[k], rtol=1e-5, atol=1e-6)
    tri = opt._engines[0].triton
    return tri.launches if tri is not None else 0, opt.fast_steps


@cuda
@pytest.mark.parametrize("triton", [True, False, None], ids=["triton", "torch-kernel", "default"])
def test_wrapper_with_triton_step(ranks, triton):
    ((launches, fast_steps),) = ranks(1).run(_rank_wrapper, triton, timeout=300)
    assert fast_steps == 3
    assert launches == (0 if triton is False else 3)  # the default is the Triton step


class _Unbuildable:
    """Stands in for a Triton kernel that cannot be compiled on this device."""

    def __getitem__(self, grid):
        raise RuntimeError("ptxas fatal: unsupported target (stand-in for a failed build)")


def _rank_unbuildable():
    """The default config with a kernel that fails to build, against triton_adam_step=False
    on the same data: one warning, then torch's kernel, bit for bit."""
    import warnings

    from mfsdp_optim.optim._engines import _triton_adam

    saved = dict(_triton_adam._state)
    _triton_adam._state.update(kernel=_Unbuildable(), failed=False)
    try:
        runs = {}
        for name, flag in (("default", None), ("torch-kernel", False)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mesh, params, ref, opt, ref_opt = _wrapper_pair(SHAPES, flag)
                for step in range(4):
                    _clipped_step_both(mesh, SHAPES, step, params, ref, opt, ref_opt)
                    opt.zero_grad()
                    ref_opt.zero_grad()
            notes = [str(w.message) for w in caught if w.category is RuntimeWarning]
            state = [
                {
                    k: getattr(v, "_local_tensor", v).clone()
                    for k, v in opt.optimizer.state[p].items()
                }
                for p in params
            ]
            runs[name] = ([p._local_tensor.clone() for p in params], state, notes)
            tri = opt._engines[0].triton
            runs[name + " launches"] = tri.launches if tri else 0
        failed = _triton_adam._state["failed"]
    finally:
        _triton_adam._state.clear()
        _triton_adam._state.update(saved)
    return runs, failed


@cuda
def test_a_kernel_that_cannot_be_built_falls_back_to_torch(ranks):
    ((runs, failed),) = ranks(1).run(_rank_unbuildable, timeout=300)
    (params, state, notes), (ref_params, ref_state, ref_notes) = (
        runs["default"],
        runs["torch-kernel"],
    )
    assert failed and runs["default launches"] == 0
    assert len(notes) == 1 and "triton_adam_step=False" in notes[0], notes
    assert not ref_notes
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    for mine, theirs in zip(state, ref_state, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def _rank_cpu(triton: bool):
    """On CPU the option changes nothing: torch's fused kernel runs, bit for bit."""
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((1,))
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(
            DTensor.from_local(torch.randn(s, generator=gen), mesh, [Shard(0)], run_check=False)
        )
        for s in SHAPES
    ]
    opt = FullyShardedOptimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True),
        OptimizerConfig(clip_grad=0.5, triton_adam_step=triton),
    )
    for step in range(3):
        g_gen = torch.Generator().manual_seed(10 + step)
        for p in params:
            p.grad = DTensor.from_local(
                torch.randn(p.shape, generator=g_gen), mesh, [Shard(0)], run_check=False
            )
        opt.step()
        opt.zero_grad()
    launches = opt._engines[0].triton.launches if opt._engines[0].triton is not None else 0
    return [p._local_tensor.clone() for p in params], launches


def test_option_is_inert_on_cpu(ranks):
    ((with_opt, launches),) = ranks(1).run(_rank_cpu, True)
    ((without, _),) = ranks(1).run(_rank_cpu, False)
    assert launches == 0
    assert all(torch.equal(a, b) for a, b in zip(with_opt, without, strict=True))


@cuda
def test_declines_small_tensors_by_default(monkeypatch):
    from mfsdp_optim.optim._engines import _triton_adam

    monkeypatch.undo()  # the default threshold
    tri = _triton_adam.TritonAdam()
    p, g, m, v, s = _lists(torch.float32, 4)  # about 5000 elements per tensor on average
    assert not tri.step(_group(True, False, 0.0), p, g, m, v, s, None)
    big = [torch.zeros(1 << 20, device="cuda") for _ in range(4)]
    steps = [torch.zeros((), device="cuda") for _ in range(4)]
    assert tri.step(
        _group(True, False, 0.0),
        big,
        [b.clone() for b in big],
        [b.clone() for b in big],
        [b.clone() for b in big],
        steps,
        None,
    )


# ------------------------------------------------------------------ persistent tables (issue 16)


class _Holder:
    triton_table = None


def _torch_adamw_(p, g, m, v, s, divisor):
    torch._foreach_add_(s, 1)
    torch._fused_adamw_(
        p,
        _clone(g),
        m,
        v,
        [],
        s,
        amsgrad=False,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.1,
        eps=1e-8,
        maximize=False,
        grad_scale=divisor,
        found_inf=None,
    )


@cuda
@pytest.mark.parametrize("realloc", [False, True], ids=["same-grads", "new-grads"])
def test_kept_table_3000_small_tensors(monkeypatch, realloc):
    """3000 small tensors through a kept table at the default size rule, against torch's
    kernel, with the grads re-allocated between steps or not."""
    from mfsdp_optim.optim._engines import _triton_adam

    monkeypatch.undo()  # the default threshold: a kept table takes small tensors anyway
    tri, holder = _triton_adam.TritonAdam(), _Holder()
    group = _group(True, False, 0.1)
    p, g, m, v, s = _lists(torch.float32, 5, [(512, 2)] * 2990 + [(0,)] * 10)
    rp, rm, rv, rs = _clone(p), _clone(m), _clone(v), _clone(s)
    keep_alive = []
    for step in range(4):
        divisor = torch.tensor(1.5 + step, device="cuda")
        assert tri.step(group, p, g, m, v, s, divisor, holder=holder)
        _torch_adamw_(rp, g, rm, rv, rs, divisor)
        if realloc:
            keep_alive.append(g)  # the old grads stay allocated: the new ones move
            g = [x * 0.5 for x in g]
    assert tri.launches == 4 and tri.builds == 1
    uploads = holder.triton_table.table.uploads
    # grad offsets are relative to the first grad: new grads laid out like the old ones need no
    # upload, so with re-allocated grads the count depends on the allocator (seen: 3 and 4)
    assert uploads <= 4 if realloc else uploads == 1, uploads
    for a, b in ((p, rp), (m, rm), (v, rv)):
        torch.testing.assert_close(
            torch.cat([x.flatten() for x in a]),
            torch.cat([x.flatten() for x in b]),
            rtol=5e-5,
            atol=1e-5,
        )
    assert all(torch.equal(a, b) for a, b in zip(s, rs, strict=True))


def _wrapper_reload_run(n_params: int):
    """6 clipped AdamW steps of many small params through the wrapper with the Triton step at
    its default size rule, new grads at every step, ``load_state_dict`` after step 3, against
    torch's clip + fused step; returns (launches, builds, fast steps)."""
    shapes = [(64, 8)] * n_params
    mesh, params, ref, opt, ref_opt = _wrapper_pair(shapes, True)
    for step in range(6):
        if step == 3:
            opt.load_state_dict(opt.state_dict())  # new state tensors: a new table
        _clipped_step_both(mesh, shapes, step, params, ref, opt, ref_opt)
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p._local_tensor, q.detach(), rtol=1e-5, atol=1e-6)
    return opt._engines[0].triton.launches, opt._engines[0].triton.builds, opt.fast_steps


@cuda
def test_wrapper_kept_tables_survive_regrads_and_reload(ranks):
    ((launches, builds, fast_steps),) = ranks(1).run(_wrapper_reload_run, 3000, timeout=300)
    assert fast_steps == 5  # step 1 creates the state on the generic path
    assert launches == 5 and builds == 2  # one table before the reload, one after


@cuda
def test_kept_table_under_graph_capture():
    """Under CUDA graph capture the kernel launches only with a holder's table that an eager
    call on the capturing stream built and pointed at these grads (a capture uploads nothing);
    the replays read the hyperparameters from the table, patched between replays, and match
    eager calls of the same kernel bit for bit, the found_inf gate included."""
    from mfsdp_optim.optim._engines import _triton_adam

    tri, holder = _triton_adam.TritonAdam(), _Holder()
    group = _group(True, False, 0.1)
    p, g, m, v, s = _lists(torch.float32, 3)
    rp, rm, rv, rs = _clone(p), _clone(m), _clone(v), _clone(s)
    ref_tri, ref_holder = _triton_adam.TritonAdam(), _Holder()
    divisor = torch.tensor(2.0, device="cuda")
    gate = torch.zeros((), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):  # no table yet
            assert not tri.step(group, p, g, m, v, s, divisor, holder=holder, found_inf=gate)
        assert tri.step(group, p, g, m, v, s, divisor, holder=holder, found_inf=gate)  # eager
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            assert tri.step(group, p, g, m, v, s, divisor, holder=holder, found_inf=gate)
    torch.cuda.current_stream().wait_stream(stream)
    assert ref_tri.step(group, rp, g, rm, rv, rs, divisor, holder=ref_holder, found_inf=gate)
    for step, (lr, skip) in enumerate([(1e-2, 0.0), (3e-3, 0.0), (3e-3, 1.0), (7e-4, 0.0)]):
        group["lr"] = lr
        gate.fill_(skip)
        holder.triton_table.refresh_hparams(group)  # what the captured step does per replay
        graph.replay()
        assert ref_tri.step(group, rp, g, rm, rv, rs, divisor, holder=ref_holder, found_inf=gate)
        torch.cuda.synchronize()
        for a, b in ((p, rp), (m, rm), (v, rv), (s, rs)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), step


# ------------------------------------------------------------------- compiled, without a GPU

# the Triton releases whose compiler API (ASTSource, GPUTarget) the compile below was checked
# against: the trainers extra's pin (pyproject.toml, CI) and the GPU image's (torch 2.11's own)
_CHECKED_TRITONS = ("3.6.0", "3.9.0")
# Triton's name of its NVIDIA backend: a compile target, no device asked for (not a CUDA test)
_NVIDIA_BACKEND = "cuda"
_ARGS = {
    "p_base": "*fp32", "g_base": "*fp32", "m_base": "*fp32", "v_base": "*fp32",
    "s_base": "*fp32", "table_ptr": "*i64", "goffs_ptr": "*i64", "soffs_ptr": "*i64",
    "hp_ptr": "*i64", "divisor_ptr": "*fp32", "gate_ptr": "*fp32", "ticket_ptr": "*i32",
    "n": "i32", "n_steps": "i32", "total_items": "i32", "items_per_prog": "i32",
    "num_progs": "i32",
}  # fmt: skip
_FLAGS = dict(HAS_DIVISOR=True, HAS_GATE=True, ADAMW=True, MAXIMIZE=False, BLOCK=2048)


def _hopper_ptx(dtypes: dict[str, str], **flags) -> str:
    """The kernel's PTX for an H100 (sm_90), compiled on this machine (no GPU needed)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mfsdp_optim.optim._engines import _triton_adam

    kernel = _triton_adam._build()
    names = kernel.arg_names
    consts = {**_FLAGS, "REDUCE_BLOCK": _triton_adam._REDUCE_BLOCK, **flags}
    types = {**_ARGS, **dtypes}
    src = ASTSource(
        fn=kernel,
        signature={a: "constexpr" if a in consts else types[a] for a in names},
        constexprs={(names.index(k),): v for k, v in consts.items()},
        # every pointer 16-byte aligned, as Triton specialises a launch on aligned tensors
        attrs={
            (names.index(a),): [["tt.divisibility", 16]] for a, t in types.items() if t[0] == "*"
        },
    )
    compiled = triton_compile(
        src, target=GPUTarget(_NVIDIA_BACKEND, 90, 32), options={"num_warps": 8}
    )
    return compiled.asm["ptx"]


@pytest.mark.parametrize(
    "dtypes, flags, vectors",
    [
        ({}, dict(ALIGN=4), 8),  # fp32, 16-byte aligned: four 4-element loads a block per list
        ({}, dict(ALIGN=4, HAS_DIVISOR=False, HAS_GATE=False, ADAMW=False, MAXIMIZE=True), 8),
        ({k: "*bf16" for k in ("p_base", "g_base", "m_base", "v_base")}, dict(ALIGN=8), 4),
        ({}, dict(ALIGN=1), 0),  # not aligned: element by element
    ],
    ids=["fp32", "adam-maximize-no-divisor", "bf16", "unaligned"],
)
def test_compiles_for_hopper_with_whole_blocks_vectorised(dtypes, flags, vectors):
    """On any machine with a checked Triton: the kernel compiles for sm_90 in each variant,
    and a whole block's loads are 16-byte vector loads where the lists are aligned (the
    masked tail alone used to decide it: a mask over a run-time numel keeps Triton from
    vectorising, and every load was one element)."""
    triton = pytest.importorskip("triton")
    if triton.__version__ not in _CHECKED_TRITONS:
        pytest.skip(f"the compiler API of Triton {_CHECKED_TRITONS} (found {triton.__version__})")
    ptx = _hopper_ptx(dtypes, **flags)
    assert ptx.count("ld.global.v4") == vectors, ptx.count("ld.global.v4")
