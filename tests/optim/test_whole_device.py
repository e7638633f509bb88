"""The whole-param step under ``OptimizerConfig(host_sync=False)`` (optim/_whole, ``_verdict``).

Muon keeps its verdict on the device: a steady step (its plan built at an earlier step) reads
nothing on the host, counted with the TorchFunctionMode of ``test_host_sync`` (``item``,
``tolist``, ``__bool__`` ...), and steps bit for bit what stock torch's Muon steps on the
unsharded params, on the layouts of ``test_whole_param``. The generic path (Adafactor, an unknown
class) sends its host values through a host-side group and must step the same bits too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import get_pool  # noqa: E402
from test_host_sync import CountHostReads  # noqa: E402
from test_whole_param import (  # noqa: E402
    LAYOUTS,
    OPTIMIZERS,
    _assert_like_reference,
    _grad_spec,
    _param_spec,
)

pytestmark = pytest.mark.timeout(300)


def _rank_train_on_device(specs, opt_name, steps=3, break_it=False):
    """``step_whole_params`` with a ``DeviceVerdict`` at every step, next to the class on this
    rank's stripe of the unsharded params: (host reads per step, verdict per step)."""
    import torch.distributed as dist
    from _layouts import build_grad, global_tensor, stripe_of

    from mfsdp_optim.optim._whole import DeviceVerdict, step_whole_params

    cls, kw = OPTIMIZERS[opt_name]
    rank = dist.get_rank()
    params = [torch.nn.Parameter(build_grad(_param_spec(s))) for s in specs]
    opt = cls(params, **kw)
    ref = [torch.nn.Parameter(global_tensor(_param_spec(s), stripe_of(rank, s))) for s in specs]
    ref_opt = cls(ref, **kw)
    plan, reads, bads = None, [], []
    for step in range(steps):
        for p, r, s in zip(params, ref, specs, strict=True):
            p.grad = build_grad(_grad_spec(s, step), check=False).to(p.dtype)
            r.grad = global_tensor(_grad_spec(s, step), stripe_of(rank, s)).to(p.dtype)
        verdict = DeviceVerdict(torch.device("cpu"))
        counter = CountHostReads()
        with counter:
            plan = step_whole_params(opt, params, plan_cache=plan, verdict=verdict)
        reads.append(len(counter.reads))
        bads.append(bool(verdict.bad))
        ref_opt.step()
    if break_it:
        params[0]._local_tensor.view(-1)[:1].add_(1e-3)
    _assert_like_reference(opt, ref_opt, params, ref, specs)
    return reads, bads


@pytest.mark.parametrize("opt_name", ["Muon", "MuonPlain", "Adafactor", "NormalizedSGD"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bit_for_bit_vs_unsharded_without_host_sync(layout, opt_name):
    world, specs = LAYOUTS[layout]
    for reads, bads in get_pool(world).run(_rank_train_on_device, specs, opt_name):
        assert bads == [False] * 3, bads
        if opt_name.startswith("Muon"):  # the first step builds the plan (reads the host)
            assert reads[1:] == [0, 0], reads


def test_a_broken_update_is_noticed_without_host_sync():
    with pytest.raises(AssertionError, match="param 0"):
        get_pool(2).run(
            _rank_train_on_device, LAYOUTS["1d-uneven-empty-2"][1], "Muon", break_it=True
        )
