"""HF accelerate 1.15 with the wrapper, on 2 gloo CPU ranks under torchrun's environment.

accelerate engages FSDP2 only on CUDA-like devices, so the full recipe runs on a GPU
(``scripts/accelerate_gpu.py``). On CPU ranks:

* a CPU accelerator (DDP over plain params) is refused by ``shard`` and ``prepare`` with what to
  change;
* accelerate's real ``AcceleratedOptimizer`` over the wrapper (``prepare_optimizer``: the state
  dict round trip for device placement, ``step()`` returning None, ``zero_grad``) trains like
  stock AdamW under ``accelerator.clip_grad_norm_`` (within 1e-6 relative; the clip fires on
  some steps), and ``unwrap(optimizer).last_grad_norm`` is the brute-force pre-clip norm;
* the GPU script's own ``compare()`` (stock vs recipe, ``save_state``/``load_state``, refused
  orders) with accelerate's state switched to FSDP2 after the Accelerator is built: its FSDP2
  code paths (``fsdp2_prepare_model``, prepare's param switch, DCP save and load) run for real
  on gloo; only the device check is bypassed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from _frameworks import assert_close, batch, brute_norm, full_params, make_model, need
from _ranks import torchrun_env

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, CLIP, LR = 6, 1.0, 5e-2


@contextlib.contextmanager
def _accelerate_env():
    """torchrun's variables, and everything accelerate sets (ACCELERATE_USE_FSDP, its state
    singletons) undone afterwards: the pool's ranks run other tests next."""
    from accelerate.state import AcceleratorState

    saved = dict(os.environ)
    try:
        with torchrun_env():
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved)


def _shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _rank_cpu_refused():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from mfsdp_optim import FullyShardedOptimizer
    from mfsdp_optim.integrations.accelerate import prepare, shard

    messages = []
    with _accelerate_env():
        acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = _shard(make_model())
        wrapper = FullyShardedOptimizer(torch.optim.AdamW(model.parameters()), model_chunks=[model])
        for call in (lambda: shard(acc, make_model()), lambda: prepare(acc, model, wrapper)):
            try:
                call()
            except RuntimeError as exc:
                messages.append(str(exc))
    return messages


def test_a_cpu_accelerator_is_refused_with_what_to_change(ranks):
    need("accelerate")
    for messages in ranks(2).run(_rank_cpu_refused, timeout=120):
        assert len(messages) == 2, messages
        for m in messages:
            assert "fsdp_version=2" in m and "CUDA" in m and "MULTI_CPU" in m, m


def _rank_accelerated_optimizer(wrapped: bool):
    import torch.distributed as dist
    from accelerate import Accelerator

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig
    from mfsdp_optim.integrations.accelerate import unwrap

    out = {"losses": [], "norms": [], "brute": [], "returns": []}
    with _accelerate_env():
        acc = Accelerator(cpu=True)
        model = _shard(make_model())
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        if wrapped:
            opt = FullyShardedOptimizer(opt, OptimizerConfig(clip_grad=CLIP), model_chunks=[model])
        opt = acc.prepare_optimizer(opt)
        for step in range(1, STEPS + 1):
            tokens, labels = batch(dist.get_rank(), step)
            loss = torch.nn.functional.cross_entropy(
                model(tokens).flatten(0, 1), labels.flatten(0, 1)
            )
            acc.backward(loss)
            out["brute"].append(brute_norm(model.parameters()))
            if wrapped:
                out["returns"].append(opt.step())
                out["norms"].append(unwrap(opt).last_grad_norm)
            else:
                out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
            opt.zero_grad()
            out["losses"].append(float(loss))
        out["params"] = full_params(model)
    return out


def test_accelerated_optimizer_steps_the_wrapper_like_stock(ranks):
    need("accelerate")
    pool = ranks(2)
    stocks = pool.run(_rank_accelerated_optimizer, False, timeout=120)
    ours = pool.run(_rank_accelerated_optimizer, True, timeout=120)
    for stock, mine in zip(stocks, ours, strict=True):
        assert len(mine["losses"]) == STEPS and mine["returns"] == [None] * STEPS
        assert max(stock["norms"]) > CLIP > min(stock["norms"])
        assert_close(mine["losses"], stock["losses"], 1e-6, "losses")
        assert_close(mine["params"], stock["params"], 1e-6, "params")
        assert_close(mine["norms"], mine["brute"], 1e-6, "unwrap(opt).last_grad_norm")
        assert_close(mine["norms"], stock["norms"], 1e-6, "vs accelerator.clip_grad_norm_")


def _script():
    spec = importlib.util.spec_from_file_location(
        "accelerate_gpu", os.path.join(ROOT, "scripts", "accelerate_gpu.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fsdp2_on_cpu():
    """An Accelerator with the FSDP2 plugin whose state says FSDP, on CPU (accelerate itself
    only says so on CUDA-like devices)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # both singletons: each AcceleratorState() copies PartialState's fields over its own
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    return acc


def _rank_script(folder):
    with _accelerate_env():
        return _script().compare(_fsdp2_on_cpu, folder)


def test_the_gpu_script_on_cpu_ranks_in_fsdp2_mode(ranks):
    need("accelerate")
    with tempfile.TemporaryDirectory() as folder:
        # ranks that see no GPU: on a GPU machine, accelerate's fully_shard (no mesh) would
        # put the params on CUDA over the pool's gloo group (the GPU run: scripts/accelerate_gpu.py)
        results = ranks(2, cuda=False).run(_rank_script, folder, timeout=240)
    for rows in results:
        assert len(rows) == 9
        failed = [r for r in rows if not r[2]]
        assert not failed, failed


def test_the_gpu_script_says_it_needs_a_gpu():
    need("accelerate")
    # run with no GPU visible, on any machine (where one is visible, the script would train)
    paths = [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    script = os.path.join(ROOT, "scripts", "accelerate_gpu.py")
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "needs a CUDA GPU" in proc.stdout
