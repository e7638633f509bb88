"""Batched Newton-Schulz by default only where proven (`batched_newton_schulz=None`).

The probe runs random matrices of each kind of batch through both ways; a batched function
that is off by one bit in one element is caught and the owner falls back to torch's per-matrix
calls, so the result is torch's either way.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from mfsdp_optim import OptimizerConfig
from mfsdp_optim.optim._whole import _muon, _ns_probe

pytestmark = pytest.mark.timeout(120)

COEFFICIENTS = (3.4445, -4.7750, 2.0315)


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    _ns_probe.forget_verdicts()
    yield
    _ns_probe.forget_verdicts()


def _fulls(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {u: torch.randn(s, generator=gen).bfloat16() for u, s in enumerate(shapes)}


def _groups(n, steps=5):
    return {u: {"ns_coefficients": COEFFICIENTS, "ns_steps": steps, "eps": 1e-7} for u in range(n)}


def _torchs(fulls, steps=5):
    inputs = {u: f.clone() for u, f in fulls.items()}
    out = {u: _zeropower_via_newtonschulz(x, COEFFICIENTS, steps, 1e-7) for u, x in inputs.items()}
    return out, inputs


def _off_by_one_bit(real):
    def batched(stack, coefficients, steps, eps):
        result, normalised = real(stack, coefficients, steps, eps)
        result = result.clone()
        result.view(torch.int16)[0, 0, 0] += 1  # one element one bf16 step away
        return result, normalised

    return batched


def test_the_probe_passes_torchs_batches_on_cpu_once_per_kind():
    sample = torch.zeros(48, 24, dtype=torch.bfloat16)
    before = _ns_probe.probes_run()
    args = (COEFFICIENTS, 5, 1e-7, _muon.batched_newton_schulz)
    assert _ns_probe.batched_is_exact(sample, 3, *args)
    assert _ns_probe.batched_is_exact(sample, 3, *args)
    assert _ns_probe.probes_run() == before + 1, "a kind is probed once"
    assert _ns_probe.batched_is_exact(sample, 4, *args)  # another batch size: another kind
    assert _ns_probe.batched_is_exact(sample.T, 3, *args)  # another layout: another kind
    assert _ns_probe.probes_run() == before + 3


@pytest.mark.parametrize("batched", [None, True, False])
def test_newton_schulz_all_gives_torchs_bits(batched):
    shapes = [(40, 24)] * 3 + [(24, 40)] * 2 + [(16, 16)]
    fulls = _fulls(shapes)
    want, want_inputs = _torchs(fulls)
    before = _ns_probe.probes_run()
    got = _muon.newton_schulz_all(fulls, _groups(len(shapes)), batched)
    for u in want:
        assert torch.equal(got[u], want[u]), u
        assert torch.equal(fulls[u], want_inputs[u]), u  # the normalised input left behind
    probes = _ns_probe.probes_run() - before
    assert probes == (2 if batched is None else 0)  # two shapes batch (the third is alone)


def test_a_batched_kernel_off_by_one_bit_is_caught_by_the_default(monkeypatch):
    monkeypatch.setattr(
        _muon, "batched_newton_schulz", _off_by_one_bit(_muon.batched_newton_schulz)
    )
    shapes = [(40, 24)] * 3
    fulls = _fulls(shapes, seed=1)
    want, _ = _torchs(fulls)
    got = _muon.newton_schulz_all({u: f.clone() for u, f in fulls.items()}, _groups(3), None)
    assert all(torch.equal(got[u], want[u]) for u in want), "the default fell back to torch's"
    forced = _muon.newton_schulz_all({u: f.clone() for u, f in fulls.items()}, _groups(3), True)
    assert not all(torch.equal(forced[u], want[u]) for u in want), "True batches regardless"


def test_the_config_field():
    assert OptimizerConfig().batched_newton_schulz is None
    assert OptimizerConfig(batched_newton_schulz=True).batched_newton_schulz is True
    assert OptimizerConfig(batched_newton_schulz=False).batched_newton_schulz is False
    with pytest.raises(TypeError, match="batched_newton_schulz must be True or False or None"):
        OptimizerConfig(batched_newton_schulz=1)
