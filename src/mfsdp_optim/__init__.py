"""mfsdp_optim: make any torch.optim optimizer a correct and fast citizen of FSDP2 training."""

from ._version import __version__
from .optim import (
    ConstantGradScaler,
    DynamicGradScaler,
    FullyShardedOptimizer,
    GradScaler,
    OptimizerConfig,
)
from .stats import (
    DuplicatedParam,
    GradStats,
    check_layout,
    clip_grads_with_norm_,
    count_replication,
    count_zeros,
    get_grad_norm,
    grad_stats,
)


def __getattr__(name: str):
    # ``mfsdp_optim.checkpoint`` without importing the checkpoint layer (and DCP) at import time
    if name == "checkpoint":
        import importlib

        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "FullyShardedOptimizer",
    "GradScaler",
    "OptimizerConfig",
    "DuplicatedParam",
    "check_layout",
    "GradStats",
    "clip_grads_with_norm_",
    "count_replication",
    "count_zeros",
    "get_grad_norm",
    "grad_stats",
]
