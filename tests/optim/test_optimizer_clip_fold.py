"""Clip folding: with clipping on, torch's fused optimizers take the clip as their ``grad_scale``
divisor instead of a separate multiply (see "Clip folding" in ``mfsdp_optim.optim``).

Reference: the same params and grads stepped by the plain torch optimizer on local tensors after
``torch.nn.utils.clip_grad_norm_``. Folded and unfolded wrappers must both match it (to the last
bits of the clipped grads), the grads after the step must hold the clipped values, and the fold
must be taken exactly where it is safe.
"""

from __future__ import annotations

import os

import pytest
import torch

SHAPES = [(6, 4), (3,), (5, 2, 3), (0, 4), (7, 1)]
CLIP = 0.5

FUSED = {
    "AdamW": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
    "Adam-amsgrad": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, fused=True)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1, fused=True)),
}


def _grads(step: int, bf16: bool, device: str):
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, s in enumerate(SHAPES):
        g = torch.randn(s, generator=gen) * 3.0  # global norm well above CLIP: clipping acts
        out.append((g.to(torch.bfloat16) if bf16 and i % 2 == 0 else g).to(device))
    return out


def _mesh(device: str):
    if device == "cpu":
        from _layouts import get_mesh

        return get_mesh((1,))
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (1,))


def _wrapped(cls, kw, fold: bool, bf16: bool, steps: int, device: str):
    """Train a wrapper for ``steps``; returns (params, grads after the last step, state,
    returned norms, folds taken)."""
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.optim._engines._route import DISABLE_CLIP_FOLD_ENV

    mesh = _mesh(device)
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(
            DTensor.from_local(
                torch.randn(s, generator=gen).to(device), mesh, [Shard(0)], run_check=False
            )
        )
        for s in SHAPES
    ]
    # torch's kernels: the fold is theirs (the default Triton step on CUDA applies the clip
    # inside its update and leaves the grads unclipped: tests/optim/test_triton_adam.py)
    config = OptimizerConfig(clip_grad=CLIP, triton_adam_step=False)
    opt = FullyShardedOptimizer(cls(params, **kw), config)
    old = os.environ.pop(DISABLE_CLIP_FOLD_ENV, None)
    if not fold:
        os.environ[DISABLE_CLIP_FOLD_ENV] = "1"
    norms, grads = [], []
    try:
        for step in range(steps):
            opt.zero_grad()
            for p, g in zip(params, _grads(step, bf16, device), strict=True):
                if g.dtype != p.dtype:
                    p.grad_dtype = None
                p.grad = DTensor.from_local(g, mesh, [Shard(0)], run_check=False)
            ok, norm, _ = opt.step()
            assert ok
            norms.append(norm)
            assert getattr(opt.optimizer, "grad_scale", None) is None  # nothing left behind
        grads = [p.grad._local_tensor.clone() for p in params]
    finally:
        os.environ.pop(DISABLE_CLIP_FOLD_ENV, None)
        if old is not None:
            os.environ[DISABLE_CLIP_FOLD_ENV] = old
    # the base optimizer keeps stock state: keyed by the DTensor params, DTensor values
    state = [
        {
            k: (v._local_tensor if isinstance(v, DTensor) else v).clone()
            for k, v in opt.optimizer.state[p].items()
        }
        for p in params
    ]
    return [p._local_tensor.clone() for p in params], grads, state, norms, opt.clip_folds


def _reference(cls, kw, bf16: bool, steps: int, device: str):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
    opt = cls(params, **kw)
    norms = []
    for step in range(steps):
        for p, g in zip(params, _grads(step, bf16, device), strict=True):
            p.grad = g.to(p.dtype)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
    grads = [p.grad.clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    return [p.detach().clone() for p in params], grads, state, norms


def _close(tag, a, b):
    # the fold divides by (norm + eps) / clip where the reference multiplies by its inverse:
    # the clipped grads differ in their last bit, and the update carries that along
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=lambda m: f"{tag}: {m}")


def _rank_fold(bf16: bool, device: str):
    out = {}
    for name, (cls, kw) in FUSED.items():
        if device == "cuda" and cls is torch.optim.Adagrad:
            continue  # torch's fused Adagrad is CPU-only
        ref = _reference(cls, kw, bf16, 4, device)
        for fold in (True, False):
            params, grads, state, norms, folds = _wrapped(cls, kw, fold, bf16, 4, device)
            tag = f"{name} fold={fold} bf16={bf16} {device}"
            for i in range(len(SHAPES)):
                _close(f"{tag} param {i}", params[i], ref[0][i])
                want = ref[1][i].to(grads[i].dtype)  # bf16 grads get the clipped values back
                _close(f"{tag} grad {i}", grads[i].float(), want.float())
                assert set(state[i]) == set(ref[2][i]), tag
                for k in state[i]:
                    _close(f"{tag} state {i} {k}", state[i][k], ref[2][i][k])
            for n, r in zip(norms, ref[3], strict=True):
                assert abs(n - r) <= 1e-5 * r, (tag, n, r)
            out[(name, fold)] = folds
    return out


CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-grads", "bf16-grads"])
def test_fold_matches_clip_then_step(ranks, bf16, device):
    (out,) = ranks(1).run(_rank_fold, bf16, device, timeout=300)
    for name in FUSED:
        if (name, True) not in out:
            continue
        assert out[(name, True)] == 4, (name, out)  # every step folded
        assert out[(name, False)] == 0, (name, out)


def _rank_when_not():
    from _layouts import get_mesh
    from torch.distributed.tensor import DTensor, Shard

    from mfsdp_optim.optim import FullyShardedOptimizer, OptimizerConfig

    mesh = get_mesh((1,))

    class MyAdamW(torch.optim.AdamW):  # a subclass may ignore grad_scale: never folded
        pass

    def run(make, clip=CLIP, user_grad_scale=False, explicit_clip=False):
        params = [
            torch.nn.Parameter(
                DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)], run_check=False)
            )
        ]
        opt = FullyShardedOptimizer(make(params), OptimizerConfig(clip_grad=clip))
        if user_grad_scale:
            opt.optimizer.grad_scale = torch.tensor(1.0)
        for _ in range(2):
            params[0].grad = DTensor.from_local(
                torch.full((4, 2), 5.0), mesh, [Shard(0)], run_check=False
            )
            if explicit_clip:
                opt.prepare_grads()
                opt.clip_grad_norm(CLIP)
                opt.step_with_ready_grads()
            else:
                opt.step()
            opt.zero_grad()
        return opt.clip_folds

    return {
        "fused": run(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)),
        "foreach": run(lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True)),
        "subclass": run(lambda ps: MyAdamW(ps, lr=0.1, fused=True)),
        "no_clip": run(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True), clip=0.0),
        "user_grad_scale": run(
            lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True), user_grad_scale=True
        ),
        "explicit_clip": run(
            lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True), clip=0.0, explicit_clip=True
        ),
        "mixed_groups": run(
            lambda ps: torch.optim.SGD(
                [{"params": ps, "fused": True}, {"params": [], "fused": False}], lr=0.1
            )
        ),
    }


def test_fold_taken_only_where_safe(ranks):
    (out,) = ranks(1).run(_rank_when_not)
    assert out == {
        "fused": 2,
        "foreach": 0,
        "subclass": 0,
        "no_clip": 0,
        "user_grad_scale": 0,
        "explicit_clip": 0,
        "mixed_groups": 0,
    }, out
