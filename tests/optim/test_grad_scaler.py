"""Grad scalers: growth, backoff, hysteresis, min scale, state dicts (single process)."""

from __future__ import annotations

import pytest
import torch

from mfsdp_optim.optim import ConstantGradScaler, DynamicGradScaler


def test_dynamic_backoff_hysteresis_growth_and_min_scale():
    s = DynamicGradScaler(
        16.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
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
    assert (
        b.state_dict()
        == a.state_dict()
        == {"scale": 64.0, "growth_tracker": 0, "hysteresis_tracker": 1}
    )
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


BAD_ARGS = [
    # (constructor call, exception, words the message must hold)
    (lambda: ConstantGradScaler(1e39), ValueError, "float32's normal range"),
    (lambda: ConstantGradScaler(1e-46), ValueError, "float32's normal range"),
    (lambda: DynamicGradScaler(2.0**200), ValueError, "initial_scale must be a finite number > 0"),
    (lambda: DynamicGradScaler(2.0**127), ValueError, "float32's normal range"),
    (lambda: ConstantGradScaler("8"), TypeError, "initial_scale must be a number, got str"),
    (lambda: ConstantGradScaler(True), TypeError, "initial_scale must be a number"),
    (lambda: ConstantGradScaler(float("nan")), ValueError, "initial_scale must be a finite"),
    (
        lambda: DynamicGradScaler(hysteresis=float("nan")),
        ValueError,
        "hysteresis must be an integer >= 1, got nan",
    ),
    (lambda: DynamicGradScaler(hysteresis=2.5), ValueError, "hysteresis must be an integer"),
    (lambda: DynamicGradScaler(hysteresis="2"), TypeError, "hysteresis must be an integer"),
    (lambda: DynamicGradScaler(growth_interval=0), ValueError, "growth_interval must be >= 1"),
    (lambda: DynamicGradScaler(growth_interval=None), TypeError, "growth_interval must be an"),
    (
        lambda: DynamicGradScaler(growth_factor=float("inf")),
        ValueError,
        "growth_factor must be a finite number",
    ),
    (lambda: DynamicGradScaler(growth_factor="2"), TypeError, "growth_factor must be a number"),
    (
        lambda: DynamicGradScaler(backoff_factor=float("nan")),
        ValueError,
        "backoff_factor must be a finite number",
    ),
    (lambda: DynamicGradScaler(backoff_factor=0.0), ValueError, "backoff_factor must be in"),
    (lambda: DynamicGradScaler(min_scale=0.0), ValueError, "min_scale must be a finite number > 0"),
    (lambda: DynamicGradScaler(min_scale=1e-40), ValueError, "float32's normal range"),
    (lambda: DynamicGradScaler(min_scale=float("nan")), ValueError, "min_scale must be a finite"),
]


@pytest.mark.parametrize("i", range(len(BAD_ARGS)))
def test_every_argument_is_validated(i):
    call, cls, words = BAD_ARGS[i]
    with pytest.raises(cls, match=words.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_extreme_but_valid_scales_and_growth_stops_at_the_float32_range():
    import torch

    s = DynamicGradScaler(2.0**125, growth_interval=1, min_scale=2.0**-126)
    s.update(False)
    s.update(False)  # 2**126 is the cap: 1 / scale stays a normal float32
    assert s.get_scale() == 2.0**126
    assert torch.isfinite(s.scale) and float(s.inv_scale) == 2.0**-126
    assert ConstantGradScaler(2.0**-126).get_scale() == 2.0**-126


BAD_STATES = [
    ({"scale": 2.0, "growth_tracker": -1, "hysteresis_tracker": 1}, "growth_tracker must be >= 0"),
    (
        {"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": -3},
        "hysteresis_tracker must be >= 0",
    ),
    ({"scale": 2.0, "growth_tracker": 0.5, "hysteresis_tracker": 1}, "growth_tracker must be an"),
    (
        {"scale": 2.0, "growth_tracker": 7, "hysteresis_tracker": 1},
        "growth_tracker must be < growth_interval",
    ),
    ({"scale": 1e39, "growth_tracker": 0, "hysteresis_tracker": 1}, "float32's normal range"),
    ({"scale": "2", "growth_tracker": 0, "hysteresis_tracker": 1}, "scale must be a number"),
    ({"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": 1, "x": 1}, "unexpected keys"),
    ([2.0, 0, 1], "state_dict must be a dict"),
]


@pytest.mark.parametrize("i", range(len(BAD_STATES)))
def test_bad_states_are_refused_and_change_nothing(i):
    state, words = BAD_STATES[i]
    s = DynamicGradScaler(64.0, growth_interval=5, hysteresis=2)
    s.update(True)
    before = s.state_dict()
    with pytest.raises((TypeError, ValueError), match=words):
        s.load_state_dict(state)
    assert s.state_dict() == before


def test_hysteresis_tracker_stays_at_zero_once_spent():
    s = DynamicGradScaler(64.0, hysteresis=2, min_scale=1.0)
    for _ in range(10):
        s.update(True)
    assert s.state_dict()["hysteresis_tracker"] == 0 and s.get_scale() == 1.0
    t = DynamicGradScaler(64.0, hysteresis=2)
    t.load_state_dict(s.state_dict())  # what it saves, it loads
    with pytest.raises(ValueError, match="set it to 0"):
        t.load_state_dict({"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": -5})
    c = ConstantGradScaler(4.0)
    with pytest.raises(ValueError, match="unexpected keys"):
        c.load_state_dict(s.state_dict())
    assert c.get_scale() == 4.0
