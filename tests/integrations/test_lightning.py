"""Lightning 2.6 with the wrapper on 2 gloo ranks: the Trainer (ModelParallelStrategy) and Fabric.

Each rank of the pool runs the real ``lightning.pytorch.Trainer`` / ``lightning.fabric.Fabric``
under ``torchrun``'s environment (``_ranks.torchrun_env``: Lightning detects torchrun and joins the
pool's process group). Against each framework's stock run, AdamW clipped to 1.0 by the
framework's own clipping (``gradient_clip_val=1.0``, ``fabric.clip_gradients(max_norm=1.0)``),
which fires: losses and params within 1e-6 relative (the norm is summed in another order), the
logged norm (``GradNormCallback``'s metric; Fabric: ``step()``'s return) the brute-force pre-clip
global norm of every step, a save and resume through the framework's own DCP checkpoint bit for
bit, and ``gradient_clip_val`` with the wrapper refused on every rank before the first step.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from _frameworks import assert_close, batch, brute_norm, full_params, make_model, need
from _ranks import torchrun_env

pytestmark = pytest.mark.timeout(300)

STEPS, CLIP, LR = 3, 1.0, 5e-2


def _loss(model, rank, step):
    tokens, labels = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in (model[1], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _module(wrapped: bool):
    import lightning.pytorch as pl
    import torch.distributed as dist

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    class Module(pl.LightningModule):
        """The token model; each step's batch follows ``global_step`` (so a resumed run sees
        the batches the full run saw); keeps each step's loss and pre-clip brute-force norm."""

        def __init__(self):
            super().__init__()
            self.model = make_model()
            self.losses, self.brute = [], []

        def configure_model(self):
            _shard(self.model, self.device_mesh["data_parallel"])

        def training_step(self, item, batch_idx):
            loss = _loss(self.model, dist.get_rank(), self.global_step + 1)
            self.losses.append(float(loss))
            return loss

        def on_before_optimizer_step(self, optimizer):  # after backward, before any clip
            self.brute.append(brute_norm(self.parameters()))

        def configure_optimizers(self):
            adamw = torch.optim.AdamW(self.parameters(), lr=LR, foreach=True)
            if not wrapped:
                return adamw
            return FullyShardedOptimizer(
                adamw, OptimizerConfig(clip_grad=CLIP), model_chunks=[self]
            )

    return Module()


def _trainer(folder, epochs, wrapped, clip_val=None):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import ModelParallelStrategy

    from mfsdp_optim.integrations.lightning import GradNormCallback

    class Recorder(Logger):
        name, version = "recorder", 0

        def __init__(self):
            super().__init__()
            self.norms = []

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            if "grad_norm" in metrics:
                self.norms.append(float(metrics["grad_norm"]))

    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=epochs,
        gradient_clip_val=clip_val if wrapped else CLIP,  # the stock run: Lightning clips
        callbacks=[GradNormCallback()] if wrapped else [],
        logger=Recorder(),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=folder,
    )


def _fit(folder, wrapped, epochs, ckpt_in=None, ckpt_out=None, clip_val=None):
    """``epochs`` epochs of ``STEPS`` steps (resumed from ``ckpt_in``): losses, brute-force
    norms, logged norms, params."""
    module = _module(wrapped)
    trainer = _trainer(folder, epochs, wrapped, clip_val)
    data = torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)
    trainer.fit(module, data, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    return {
        "losses": module.losses,
        "brute": module.brute,
        "norms": trainer.logger.norms,
        "params": full_params(module.model),
    }


def _rank_trainer(folder):
    with torchrun_env():
        stock = _fit(folder, False, 2)
        full = _fit(folder, True, 2)
        ckpt = os.path.join(folder, "ours.ckpt")
        first = _fit(folder, True, 1, ckpt_out=ckpt)
        resumed = _fit(folder, True, 2, ckpt_in=ckpt)
    return stock, full, first, resumed


def test_trainer_like_stock_lightning_and_resumes(ranks):
    need("lightning.pytorch")
    with tempfile.TemporaryDirectory() as folder:
        results = ranks(2).run(_rank_trainer, folder, timeout=280)
    for stock, full, first, resumed in results:
        assert len(stock["losses"]) == len(full["losses"]) == len(full["brute"]) == 2 * STEPS
        assert len(resumed["losses"]) == STEPS
        assert len(full["norms"]) == 2 * STEPS and len(resumed["norms"]) == STEPS
        # Lightning's clip fires on some steps of the stock run (AdamW is blind to a clip
        # that scales every step alike)
        assert max(stock["brute"]) > CLIP > min(stock["brute"])
        assert_close(full["losses"], stock["losses"], 1e-6, "losses")
        assert_close(full["params"], stock["params"], 1e-6, "params")
        assert_close(full["norms"], full["brute"], 1e-6, "logged norm vs brute force")
        assert_close(resumed["norms"], full["norms"][STEPS:], 0.0, "resumed norms")
        assert_close(first["losses"] + resumed["losses"], full["losses"], 0.0, "resumed losses")
        assert_close(resumed["params"], full["params"], 0.0, "resumed params")


def _rank_refused(folder):
    with torchrun_env():
        module = _module(True)
        trainer = _trainer(folder, 1, True, clip_val=CLIP)
        data = torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)
        try:
            trainer.fit(module, data)
        except ValueError as exc:
            return str(exc), module.losses
    return None, module.losses


def test_gradient_clip_val_with_the_wrapper_is_refused(ranks):
    need("lightning.pytorch")
    with tempfile.TemporaryDirectory() as folder:
        for message, losses in ranks(2).run(_rank_refused, folder, timeout=120):
            assert message is not None and "gradient_clip_val=None" in message, message
            assert "OptimizerConfig(clip_grad=1.0)" in message
            assert losses == []  # before the first step


def _fabric_run(folder, wrapped, steps, load=None, save=None):
    import torch.distributed as dist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from mfsdp_optim import FullyShardedOptimizer, OptimizerConfig

    strategy = ModelParallelStrategy(
        parallelize_fn=lambda m, mesh: _shard(m, mesh["data_parallel"]),
        data_parallel_size=2,
        tensor_parallel_size=1,
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(make_model())
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    if wrapped:
        adamw = FullyShardedOptimizer(adamw, OptimizerConfig(clip_grad=CLIP), model_chunks=[model])
    optimizer = fabric.setup_optimizers(adamw)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if load is not None:
        fabric.load(load, state)
    losses, brute, norms = [], [], []
    for _ in range(steps):
        state["step"] += 1
        loss = _loss(model, dist.get_rank(), state["step"])
        fabric.backward(loss)
        losses.append(float(loss))
        brute.append(brute_norm(model.parameters()))
        if wrapped:
            norms.append(optimizer.step()[1])
        else:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        fabric.save(save, state)
    return {"losses": losses, "brute": brute, "norms": norms, "params": full_params(model)}


def _rank_fabric(folder):
    ckpt = os.path.join(folder, "fabric.ckpt")
    with torchrun_env():
        stock = _fabric_run(folder, False, 2 * STEPS)
        full = _fabric_run(folder, True, 2 * STEPS)
        _fabric_run(folder, True, STEPS, save=ckpt)
        resumed = _fabric_run(folder, True, STEPS, load=ckpt)
    return stock, full, resumed


def test_fabric_like_stock_fabric_and_resumes(ranks):
    need("lightning.fabric")
    with tempfile.TemporaryDirectory() as folder:
        for stock, full, resumed in ranks(2).run(_rank_fabric, folder, timeout=280):
            assert len(full["norms"]) == 2 * STEPS and len(resumed["norms"]) == STEPS
            assert max(stock["norms"]) > CLIP > min(stock["norms"])
            assert_close(full["losses"], stock["losses"], 1e-6, "losses")
            assert_close(full["params"], stock["params"], 1e-6, "params")
            assert_close(full["norms"], full["brute"], 1e-6, "step()'s norm vs brute force")
            assert_close(full["norms"], stock["norms"], 1e-6, "norm vs fabric.clip_gradients'")
            assert_close(resumed["losses"], full["losses"][STEPS:], 0.0, "resumed losses")
            assert_close(resumed["params"], full["params"], 0.0, "resumed params")
