"""mfsdp_optim.checkpoint: fsdp_dtensor optimizer state dicts that reshard, interoperate with
torch's ``get_optimizer_state_dict`` layout and never half-load.

Map: ``save_checkpoint`` / ``load_checkpoint`` crash-safe, verified whole checkpoints
(``asynchronous=True``: a ``SaveHandle``, the write in the background; ``prepare_async_save``
its host buffers made ahead of the first one);
``build_sharded_state_dict`` one rank's state dict (a ``ParamRecord`` per param) for
``dcp.save``/``dcp.load``, ``load_sharded_state_dict`` validates it and only then restores;
``prune_to_checkpoint`` fits a load target to an older format; ``to_torch_state_dict`` /
``from_torch_state_dict`` torch's layout; ``SafeFileSystemReader``/``SafeLoadPlanner`` reads
that run no code; ``inspect_checkpoint`` and the CLI. Recipes: docs/checkpoint.md and
docs/concepts.md, "The checkpoint layer's calls". Layers it may import: ``_infra``.
"""

from .._infra.params import ParamRecord
from ._async import PrepareHandle, SaveHandle
from ._build import KeyspaceError, build_sharded_state_dict
from ._inspect import inspect_checkpoint
from ._interop import from_torch_state_dict, to_torch_state_dict

# the wrapper layer's interface (``optim._checkpointing``): in-package, not public API
from ._load import (
    StateDictMismatchError,
    load_sharded_state_dict,
    load_sharded_state_dicts,  # noqa: F401
)
from ._materialize import materialize_optimizer_state
from ._prune import prune_to_checkpoint
from ._safe import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError, safe_read_metadata
from ._save import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankDisagreementError,
    check_checkpoint,
    checkpoint_status,
    load_checkpoint,
    prepare_async_save,
    save_checkpoint,
)
from ._stateful import OptimizerStateful
from ._table import GroupMetaTable, OptimizerStateDict  # noqa: F401

__all__ = [
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "KeyspaceError",
    "OptimizerStateful",
    "ParamRecord",
    "PrepareHandle",
    "RankDisagreementError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SaveHandle",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
    "build_sharded_state_dict",
    "check_checkpoint",
    "checkpoint_status",
    "from_torch_state_dict",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_sharded_state_dict",
    "materialize_optimizer_state",
    "prepare_async_save",
    "prune_to_checkpoint",
    "safe_read_metadata",
    "save_checkpoint",
    "to_torch_state_dict",
]
