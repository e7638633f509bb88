"""The wrapper layer: ``FullyShardedOptimizer``, the mixed-precision step contract.

Map: ``_optimizer`` the public class, whole (its stock optimizer surface, stages, step, scaler
and checkpoint adapters); ``_step_hooks`` torch's step-hook contract around its ``step``;
``_config`` its options; ``_grad_scaler`` the loss scalers; ``_step_data`` the step as data
(``prepare`` over every engine in one stats collective, ``StepResult``, ``clip_norms``);
``_engines/`` one base optimizer's step machinery and caches (the ``Engine``, the one place
choosing how its step runs, its param table, the fast Adam step); ``_whole/`` whole-param
updates (Muon, Adafactor); ``_captured/`` the CUDA-graph captured step; ``_checkpointing`` the
adapter to the checkpoint layer; ``_hyper`` hyperparameter checks, ``_agreed`` the ranks'
agreement on their values; ``_kinds/`` each class's update kind, the registry of known classes
and ``classify_update`` finding it by stepping; ``_cli`` its command line (``python -m
mfsdp_optim.optim classify``); ``seam`` what the repository's tools use from inside the layer
(not public API). Nothing below imports it. Layers it may import: ``stats``, ``checkpoint``,
``_infra`` (each through its package's names, never a private module:
``tests/infra/test_layers.py``).
"""

from ._agreed import HyperparameterMismatchError
from ._config import OptimizerConfig
from ._grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from ._kinds._classify import Classification, classify_update
from ._optimizer import FullyShardedOptimizer

__all__ = [
    "Classification",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "FullyShardedOptimizer",
    "GradScaler",
    "HyperparameterMismatchError",
    "OptimizerConfig",
    "classify_update",
]
