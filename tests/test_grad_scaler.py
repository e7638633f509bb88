"""Grad scalers: growth, backoff, hysteresis, min scale, state dicts (single process)."""

from __future__ import annotations

import pytest
import torch

from mfsdp_optim.grad_scaler import ConstantGradScaler, DynamicGradScaler


def test_dynamic_backoff_hysteresis_growth_and_min_scale():
    s = DynamicGradScaler(16.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3, hysteresis=2)
    s.update(True)  # first overflow spends hysteresis, no backoff yet
    assert s.get_scale() == 16.0
    s.update(True)
    assert s.get_scale() == 8.0
    s.update(True)  # hysteresis stays spent: backs off at once
    assert s.get_scale() == 4.0
    for _ in range(5):
        s.update(True)
    assert s.get_scale() == 2.0, "never below min_scale"
    for _ in range(2):
        s.update(False)
    assert s.get_scale() == 2.0
    s.update(False)  # third clean step in a row: grow, refill hysteresis
    assert s.get_scale() == 4.0
    s.update(True)
    assert s.get_scale() == 4.0, "hysteresis refilled after growth"
    s.update(False)
    s.update(False)
    s.update(True)  # an overflow resets the growth tracker
    assert s.get_scale() == 2.0
    assert torch.equal(s.scale, torch.tensor(2.0)) and torch.equal(s.inv_scale, torch.tensor(0.5))


def test_state_dict_round_trip():
    a = DynamicGradScaler(64.0, growth_interval=2, hysteresis=3)
    for f in (True, False, True):
        a.update(f)
    b = DynamicGradScaler(1.0, growth_interval=2, hysteresis=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 64.0, "growth_tracker": 0,
                                                "hysteresis_tracker": 1}
    for f in (False, True, True, False, False):
        a.update(f)
        b.update(f)
        assert a.state_dict() == b.state_dict()
    c = ConstantGradScaler(4.0)
    c.update(True)
    assert c.get_scale() == 4.0
    d = ConstantGradScaler(1.0)
    d.load_state_dict(c.state_dict())
    assert d.get_scale() == 4.0
    with pytest.raises(ValueError, match=r"missing \['growth_tracker', 'hysteresis_tracker'\]"):
        b.load_state_dict({"scale": 2.0})


def test_bad_arguments():
    with pytest.raises(ValueError, match="initial_scale must be a finite number > 0"):
        ConstantGradScaler(0.0)
    with pytest.raises(ValueError, match="min_scale must be > 0 and <= initial_scale"):
        DynamicGradScaler(2.0, min_scale=4.0)
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicGradScaler(backoff_factor=1.0)
    with pytest.raises(ValueError, match="hysteresis must be >= 1"):
        DynamicGradScaler(hysteresis=0)
