"""Whether batched Newton-Schulz is bit for bit torch's per-matrix result, proven per kind.

``OptimizerConfig(batched_newton_schulz=None)`` (the default) batches an owner's matrices of one
shape only where this process has shown, for that very kind of batch, that the batched products
give torch's per-matrix bits. A kind is everything the matrix-product kernels are chosen by: the
matrix shape and strides, the batch size, the device, the Newton-Schulz hyperparameters and the
backend's reduced-precision switches. The proof: one probe per kind, the first time it occurs,
of random bfloat16 matrices (seeded, made on the device) through both ways, compared bit for
bit, results and normalised inputs. Different kernels or summation orders cannot agree on every
bit of a random product of this size by chance, and one kernel gives the same bits for any
data, so a kind that passed stays batched; a kind that failed stays per matrix.

The verdicts are per process (no collective): each owner decides for the matrices it runs, and
either way its result is torch's bits, so ranks never need to agree on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

__all__ = ["batched_is_exact", "forget_verdicts", "probes_run"]

Batched = Callable[[torch.Tensor, Sequence[float], int, float], tuple[torch.Tensor, torch.Tensor]]

_VERDICTS: dict[tuple, bool] = {}
_PROBES = [0]


def _switches() -> tuple:
    """The backend settings that may change which product kernel runs."""
    cuda = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        getattr(cuda, "allow_bf16_reduced_precision_reduction", None),
        getattr(cuda, "allow_fp16_reduced_precision_reduction", None),
        torch.are_deterministic_algorithms_enabled(),
    )


def batched_is_exact(
    sample: torch.Tensor,
    count: int,
    coefficients: Sequence[float],
    steps: int,
    eps: float,
    batched: Batched,
) -> bool:
    """True when ``batched`` over ``count`` matrices shaped and laid out like ``sample`` gives
    torch's per-matrix bits on ``sample``'s device (probed once per kind, then remembered)."""
    key = (
        tuple(sample.shape),
        tuple(sample.stride()),
        sample.dtype,
        sample.device,
        int(count),
        tuple(float(c) for c in coefficients),
        int(steps),
        float(eps),
        _switches(),
    )
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = _VERDICTS[key] = _probe(sample, count, coefficients, steps, eps, batched)
    return verdict


def _probe(
    sample: torch.Tensor,
    count: int,
    coefficients: Sequence[float],
    steps: int,
    eps: float,
    batched: Batched,
) -> bool:
    _PROBES[0] += 1
    device = sample.device
    gen = torch.Generator(device=device).manual_seed(0x5EED)
    stack = torch.randn((count, *sample.shape), generator=gen, device=device)
    stack = stack.to(sample.dtype)
    singles = []
    for i in range(count):  # each laid out as the owner's matrix is
        m = torch.empty_strided(sample.shape, sample.stride(), dtype=sample.dtype, device=device)
        singles.append(m.copy_(stack[i]))
    got, normalised = batched(stack.clone(), coefficients, steps, eps)
    a, b, c = coefficients
    for i, single in enumerate(singles):
        want = _zeropower_via_newtonschulz(single, (a, b, c), steps, eps)
        if not (torch.equal(got[i], want) and torch.equal(normalised[i], single)):
            return False
    return True


def probes_run() -> int:
    """How many probes this process ran (tests, diagnostics)."""
    return _PROBES[0]


def forget_verdicts() -> None:
    """Drop every verdict (tests: the next batch of each kind is probed again)."""
    _VERDICTS.clear()
