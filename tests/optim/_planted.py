"""A class for the classifier's CLI test: declared elementwise, but it reads the whole param."""

import torch


class PlantedNormSGD(torch.optim.Optimizer):
    mfsdp_update_kind = "elementwise"  # wrong on purpose: the update divides by the norm

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad / torch.linalg.vector_norm(p.grad).clamp(min=1e-12))
