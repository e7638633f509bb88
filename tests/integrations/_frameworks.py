"""What the integration tests share: the framework check (skip without it; under CI=true, which
installs the trainers extra, fail instead) and the reference pieces every framework's test uses:
a small token model, its data, the brute-force global norm and the comparisons."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

__all__ = [
    "VOCAB",
    "assert_close",
    "batch",
    "brute_norm",
    "full_params",
    "make_model",
    "need",
]

VOCAB, DIM, BATCH, SEQ = 32, 16, 4, 8


def need(module: str) -> None:
    """Skip the test without ``module`` (``pip install 'mfsdp-optim[trainers]'``); in CI the
    extra is installed, so a missing module fails instead of skipping quietly."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not importable in CI ({exc}): .ci/run installs it")
        pytest.skip(f"needs {module} ({exc}): pip install 'mfsdp-optim[trainers]'")


def make_model(seed: int = 0) -> torch.nn.Sequential:
    """Embedding, two linear layers: names ``0.weight``, ``1.weight``, ``1.bias``, ``3.*``."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
        torch.nn.Linear(DIM, 2 * DIM),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * DIM, VOCAB),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and labels for ``step`` (the same on every run)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, labels


def brute_norm(params) -> float:
    """The 2-norm of every grad's full tensor, in float64 (the reference for logged norms)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += g.double().square().sum()
    return float(total.sqrt())


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every param's full tensor (a collective over DTensor params: call on every rank)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def assert_close(got, want, rtol: float, what: str) -> None:
    """``got`` equals ``want`` (numbers, lists of them, or dicts of tensors) within ``rtol``
    relative to the largest magnitude in ``want`` (per tensor); ``rtol=0``: bit for bit."""
    if isinstance(want, dict):
        assert want and got.keys() == want.keys(), (what, got.keys(), want.keys())
        for k in want:
            assert_close(got[k], want[k], rtol, f"{what}[{k}]")
        return
    g = torch.as_tensor(got, dtype=torch.float64)
    w = torch.as_tensor(want, dtype=torch.float64)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    assert w.numel() > 0, f"{what}: nothing to compare"
    if rtol == 0:
        assert torch.equal(g, w), f"{what}: not bit for bit: {(g - w).abs().max()}"
        return
    err = (g - w).abs().max() / w.abs().max().clamp_min(1e-30)
    assert err <= rtol, f"{what}: relative error {float(err):.3g} > {rtol}"
