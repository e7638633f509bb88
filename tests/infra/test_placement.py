"""``_infra.placement.in_layout_of``: the DTensor it builds on ``like``'s own spec is the one
``DTensor.from_local`` makes (the reference, run for real), over every layout, with the same
fallback where the fast path does not apply."""

from __future__ import annotations

import pytest
import torch
from _layouts import DTYPES, build_grad, grad_specs
from hypothesis import given, settings

from mfsdp_optim._infra.placement import in_layout_of


def _compare(specs):
    from torch.distributed.tensor import DTensor

    out = []
    for spec in specs:
        like = build_grad(spec, check=False)
        for dtype in (DTYPES[spec.dtype], torch.float64):  # the param's dtype, another
            local = torch.randn(like._local_tensor.shape).to(dtype)
            got = in_layout_of(local, like)
            want = DTensor.from_local(
                local,
                like.device_mesh,
                like.placements,
                run_check=False,
                shape=like.shape,
                stride=like.stride(),
            )
            out.append(
                (
                    spec,
                    dtype,
                    type(got) is DTensor,
                    got._spec == want._spec,
                    (got.shape, got.stride(), got.dtype, got.placements, got.requires_grad)
                    == (want.shape, want.stride(), want.dtype, want.placements, False),
                    got._local_tensor is not local,  # a fresh tensor object, as from_local's
                    got._local_tensor.data_ptr() == local.data_ptr(),  # sharing the storage
                    tuple(got._local_tensor.shape) == tuple(local.shape),
                    torch.equal(got.full_tensor(), want.full_tensor()),
                )
            )
    return out


@pytest.mark.timeout(120)
@settings(max_examples=12, deadline=None)
@given(specs=grad_specs(4, allow_stripes=True).map(lambda s: [s]))
def test_in_layout_of_is_from_local(ranks, specs):
    for rows in ranks(4).run(_compare, specs, timeout=100):
        for row in rows:
            assert all(row[2:]), row


def _grad_needed():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    like = distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
    local = torch.ones(2, 2, requires_grad=True)
    got = in_layout_of(local, like)  # the slow path: autograd-aware, as from_local
    return got.requires_grad, got.grad_fn is not None


def test_in_layout_of_keeps_autograd_for_a_local_that_needs_grad(ranks):
    for requires_grad, has_fn in ranks(2).run(_grad_needed):
        assert requires_grad and has_fn
