"""``_infra.host.paused_gc``: the collector is off inside, restored after (also on an error),
and a collector the caller turned off stays off."""

from __future__ import annotations

import gc

import pytest

from mfsdp_optim._infra.host import paused_gc


def test_paused_gc_restores_the_callers_setting():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: the inner exit keeps the outer pause
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()


def test_paused_gc_as_a_decorator_keeps_the_function():
    @paused_gc()
    def inside(x: int) -> bool:
        """Doc."""
        return x == 1 and not gc.isenabled()

    assert inside(1) and gc.isenabled()
    assert inside.__doc__ == "Doc." and inside.__name__ == "inside"
