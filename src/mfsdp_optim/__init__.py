"""mfsdp_optim: make any torch.optim optimizer a correct and fast citizen of FSDP2 training."""

from . import errors
from ._version import __version__
from .errors import (
    GradPresenceError,
    HyperparameterMismatchError,
    RankFailedError,
    RankMismatchError,
    StatsArgumentMismatchError,
)
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
    # ``mfsdp_optim.checkpoint`` (and its errors) without importing the checkpoint layer (and
    # DCP) at import time
    import importlib

    if name == "checkpoint":
        return importlib.import_module(".checkpoint", __name__)
    if name in errors.CHECKPOINT_ERRORS:
        return getattr(errors, name)
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
    # errors (mfsdp_optim.errors; the checkpoint layer's load it on first access)
    "GradPresenceError",
    "HyperparameterMismatchError",
    "RankFailedError",
    "RankMismatchError",
    "StatsArgumentMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "KeyspaceError",
    "RankDisagreementError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
]
