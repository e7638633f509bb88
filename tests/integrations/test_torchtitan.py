"""torchtitan 0.3 with the wrapper on 2 gloo ranks, running torchtitan's own ``Trainer.train_step``.

torchtitan's ``Trainer.__init__`` needs a CUDA device, a tokenizer and a dataset, so each run
builds the trainer object with ``__new__`` and sets what ``train_step`` reads: the real
optimizers container (built by its ``Config.build`` hook), the real lr schedulers, the real
``CheckpointManager``; the model is an FSDP2-sharded token model; a recorder stands in for the
metrics processor (it keeps what ``train_step`` logs) and a stub for ``ParallelDims`` (no data
parallel metrics reduction: each rank logs its own loss). Against it:

* the stock run (stock container, AdamW, torchtitan's clip to ``max_norm=1.0``, which fires):
  losses and params within 1e-6 relative (the norm is summed in another order, so the clip
  coefficient differs in the last bits); with a clip that never fires, bit for bit;
* the logged norm is the pre-clip global norm every step (brute force over ``full_tensor()``
  in a step pre-hook) and torchtitan's ``clip_grad_norm_`` is never called;
* save and resume through ``CheckpointManager``: the resumed run continues bit for bit, and a
  stock checkpoint resumes into the wrapped container;
* Muon + AdamW against the same torch optimizers on an unsharded copy fed the same batches;
* the stock ``Trainer`` stepping the wrapped container is refused on every rank, params unchanged.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from _frameworks import assert_close, batch, brute_norm, full_params, make_model, need

pytestmark = pytest.mark.timeout(300)

STEPS, MAX_NORM, LR = 4, 1.0, 5e-2


def _shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loss(pred, labels, global_valid_tokens):
    loss = torch.nn.functional.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum"
    )
    return loss / global_valid_tokens, None


class _Metrics:
    """Keeps what ``train_step`` hands ``MetricsProcessor.log``."""

    def __init__(self):
        self.losses, self.norms = [], []

    def should_log(self, step):
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.losses.append(global_avg_loss)
        self.norms.append(grad_norm)


_NO_PARALLEL = SimpleNamespace(
    dp_enabled=False,
    pp_enabled=False,
    cp_enabled=False,
    dp_cp_enabled=False,
    ep_enabled=False,
    get_optional_mesh=lambda name: None,
)


def _optimizer_config(wrapped: bool, muon: bool):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    from mfsdp_optim.integrations.torchtitan import FullyShardedOptimizersContainer

    adamw = {"lr": LR, "weight_decay": 0.1, "fused": False, "foreach": True}
    groups = [ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=adamw)]
    if muon:
        muon_kwargs = {"lr": LR, "weight_decay": 0.1}
        groups.insert(
            0,
            ParamGroupConfig(
                pattern=r"^[13]\.weight$", optimizer_name="Muon", optimizer_kwargs=muon_kwargs
            ),
        )
    cls = FullyShardedOptimizersContainer if wrapped else OptimizersContainer
    return cls.Config(param_groups=groups, implementation="foreach")


def _trainer(
    wrapped: bool,
    folder: str,
    max_norm: float = MAX_NORM,
    muon: bool = False,
    stock_trainer: bool = False,
):
    """A trainer whose ``train_step`` is torchtitan's, over a freshly sharded model."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    from mfsdp_optim.integrations.torchtitan import FullyShardedTrainer

    cls = FullyShardedTrainer if wrapped and not stock_trainer else Trainer
    config = cls.Config(
        optimizer=_optimizer_config(wrapped, muon),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(max_norm=max_norm, steps=2 * STEPS, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(
            enable=True, folder="ckpt", last_save_model_only=False, keep_latest_k=0
        ),
    )
    model = _shard(make_model())
    t = cls.__new__(cls)
    t.config, t.parallel_dims, t.model_parts, t.model_config = config, _NO_PARALLEL, [model], None
    t.device, t.step, t.ntokens_seen = torch.device("cpu"), 0, 0
    t.gradient_accumulation_steps = t.num_pipeline_parallel_microbatches = 1
    t.optimizers = config.optimizer.build(model_parts=[model])
    t.lr_schedulers = config.lr_scheduler.build(
        optimizers=t.optimizers, training_steps=config.training.steps
    )
    t.metrics_processor, t.loss_fn = _Metrics(), _loss
    t.train_context = dist_utils.get_spmd_context(parallel_dims=None)
    t.fwd_bwd_fn = t._forward_backward_body
    t.checkpointer = config.checkpoint.build(
        dataloader=None,
        model_parts=[model],
        optimizers=t.optimizers,
        lr_schedulers=t.lr_schedulers,
        states={"train_state": t},
        sd_adapter=None,
        base_folder=folder,
    )
    return t


def _train(t, first: int, last: int):
    """Steps ``first..last`` as ``Trainer.train`` runs them; each step's brute-force pre-step
    norm (a step pre-hook on the container: nothing has clipped yet on the wrapped path)."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    rank, seen, calls = dist.get_rank(), [], []
    hook = t.optimizers.register_step_pre_hook(
        lambda *_: seen.append(brute_norm(t.model_parts[0].parameters()))
    )
    stock_clip = dist_utils.clip_grad_norm_

    def counting_clip(*args, **kwargs):
        calls.append(1)
        return stock_clip(*args, **kwargs)

    dist_utils.clip_grad_norm_ = counting_clip
    try:
        data = iter(
            [({"input": batch(rank, s)[0]}, batch(rank, s)[1]) for s in range(first, last + 1)]
        )
        for _ in range(first, last + 1):
            t.step += 1
            t.train_step(data)
    finally:
        dist_utils.clip_grad_norm_ = stock_clip
        hook.remove()
    return seen, len(calls)


def _run(wrapped, folder, steps=(1, STEPS), resume=None, save=False, **kw):
    t = _trainer(wrapped, folder, **kw)
    if resume is not None:
        assert t.checkpointer.load(step=resume), "nothing loaded"
        assert t.step == resume
    seen, clip_calls = _train(t, *steps)
    if save:
        t.checkpointer.save(t.step, last_step=True)
        t.checkpointer.maybe_wait_for_staging()
    t.checkpointer.close()
    m = t.metrics_processor
    return {
        "losses": m.losses,
        "norms": m.norms,
        "brute": seen,
        "clip_calls": clip_calls,
        "params": full_params(t.model_parts[0]),
    }


def _rank_compare(folder: str, max_norm: float):
    stock = _run(False, os.path.join(folder, "stock"), max_norm=max_norm)
    ours = _run(True, os.path.join(folder, "ours"), max_norm=max_norm)
    return stock, ours


def _check_pair(stock, ours, rtol):
    assert len(stock["losses"]) == len(ours["norms"]) == len(ours["brute"]) == STEPS
    assert stock["clip_calls"] == STEPS and ours["clip_calls"] == 0
    assert_close(ours["losses"], stock["losses"], rtol, "losses")
    assert_close(ours["params"], stock["params"], rtol, "params")
    # the logged norm: the pre-clip global norm, every step
    assert_close(ours["norms"], ours["brute"], 1e-6, "logged norm vs brute force")
    assert_close(ours["norms"], stock["norms"], 1e-6, "logged norm vs torchtitan's")


@pytest.mark.parametrize(("max_norm", "rtol"), [(MAX_NORM, 1e-6), (1e6, 0.0)])
def test_trains_like_stock_torchtitan(ranks, max_norm, rtol):
    need("torchtitan.trainer")
    with tempfile.TemporaryDirectory() as folder:
        for stock, ours in ranks(2).run(_rank_compare, folder, max_norm, timeout=240):
            if max_norm == MAX_NORM:  # what users of max_norm=1.0 get: some steps clip
                assert max(stock["norms"]) > MAX_NORM > min(stock["norms"])
            _check_pair(stock, ours, rtol)


def _rank_resume(folder: str):
    full = _run(True, os.path.join(folder, "full"), steps=(1, 2 * STEPS))
    _run(True, os.path.join(folder, "ours"), save=True)
    resumed = _run(True, os.path.join(folder, "ours"), steps=(STEPS + 1, 2 * STEPS), resume=STEPS)
    _run(False, os.path.join(folder, "stock"), save=True)
    from_stock = _run(
        True, os.path.join(folder, "stock"), steps=(STEPS + 1, 2 * STEPS), resume=STEPS
    )
    return full, resumed, from_stock


def test_checkpoint_manager_resumes_exactly(ranks):
    need("torchtitan.trainer")
    with tempfile.TemporaryDirectory() as folder:
        for full, resumed, from_stock in ranks(2).run(_rank_resume, folder, timeout=240):
            assert_close(resumed["losses"], full["losses"][STEPS:], 0.0, "resumed losses")
            assert_close(resumed["norms"], full["norms"][STEPS:], 0.0, "resumed norms")
            assert_close(resumed["params"], full["params"], 0.0, "resumed params")
            # a stock torchtitan checkpoint: the first half ran torchtitan's clip
            assert_close(from_stock["losses"], full["losses"][STEPS:], 1e-6, "from stock")
            assert_close(from_stock["params"], full["params"], 1e-6, "from stock params")
            assert_close(from_stock["norms"], from_stock["brute"], 1e-6, "from stock norms")


def _reference_muon(rank_count: int, steps: int):
    """Muon on 2-D weights + AdamW on the rest, torch's own, on an unsharded copy fed what
    FSDP feeds the sharded model: the mean over ranks of each rank's grads."""
    model = make_model()
    params = dict(model.named_parameters())
    muon = [params["1.weight"], params["3.weight"]]
    rest = [p for n, p in params.items() if n not in ("1.weight", "3.weight")]
    opts = [
        torch.optim.Muon(muon, lr=LR, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=LR, weight_decay=0.1, foreach=True),
    ]
    from torchtitan.components.optimizer import LRSchedulersContainer

    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=opts, training_steps=2 * STEPS
    )
    norms = []
    for s in range(1, steps + 1):
        grads = []
        for r in range(rank_count):
            model.zero_grad()
            tokens, labels = batch(r, s)
            loss, _ = _loss(model(tokens), labels, labels.numel())
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        for o in opts:
            o.step()
        scheds.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank_muon(folder: str):
    return _run(True, folder, muon=True)


def test_muon_and_adamw_like_torch_unsharded(ranks):
    need("torchtitan.trainer")
    norms, params = _reference_muon(2, STEPS)
    with tempfile.TemporaryDirectory() as folder:
        for ours in ranks(2).run(_rank_muon, folder, timeout=240):
            assert_close(ours["norms"], norms, 1e-6, "norms vs unsharded")
            assert_close(ours["norms"], ours["brute"], 1e-6, "norms vs brute force")
            assert_close(ours["params"], params, 1e-6, "params vs unsharded")


def _rank_stock_trainer(folder: str):
    t = _trainer(True, folder, stock_trainer=True)
    before = full_params(t.model_parts[0])
    try:
        _train(t, 1, 1)
    except RuntimeError as exc:
        after = full_params(t.model_parts[0])
        return str(exc), all(torch.equal(before[k], after[k]) for k in before)
    finally:
        t.checkpointer.close()
    return None, False


def test_stock_trainer_stepping_the_container_is_refused(ranks):
    need("torchtitan.trainer")
    with tempfile.TemporaryDirectory() as folder:
        for message, unchanged in ranks(2).run(_rank_stock_trainer, folder, timeout=120):
            assert message is not None and "FullyShardedTrainer" in message, message
            assert "training.max_norm" in message and unchanged


def test_trainer_config_hands_max_norm_to_the_wrapper():
    need("torchtitan.trainer")
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.configs import TrainingConfig

    from mfsdp_optim.integrations.torchtitan import (
        FullyShardedOptimizersContainer,
        FullyShardedTrainer,
    )

    mine = FullyShardedOptimizersContainer.Config()
    config = FullyShardedTrainer.Config(optimizer=mine, training=TrainingConfig(max_norm=0.5))
    assert config.optimizer.clip_grad == 0.5 and mine.clip_grad is None  # a copy
    with pytest.raises(ValueError, match="leave clip_grad unset"):
        FullyShardedTrainer.Config(
            optimizer=FullyShardedOptimizersContainer.Config(clip_grad=2.0),
            training=TrainingConfig(max_norm=1.0),
        )
    with pytest.raises(TypeError, match="FullyShardedOptimizersContainer.Config"):
        FullyShardedTrainer.Config(optimizer=OptimizersContainer.Config())
