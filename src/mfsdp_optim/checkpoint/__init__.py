"""mfsdp_optim.checkpoint: fsdp_dtensor optimizer state dicts that reshard, interoperate with
torch's ``get_optimizer_state_dict`` layout and never half-load.

Map: ``_on_disk`` whole checkpoint directories: ``save_checkpoint`` / ``load_checkpoint``
crash-safe, verified, on every rank or on none (``asynchronous=True``: a ``SaveHandle``, the write
in the background; ``prepare_async_save`` its host buffers made ahead of the first one),
``check_checkpoint`` / ``checkpoint_status``, ``SafeFileSystemReader`` / ``SafeLoadPlanner`` reads
that run no code. ``_state_dict`` one rank's state dict in memory: ``build_sharded_state_dict`` (a
``ParamRecord`` per param) for ``dcp.save``/``dcp.load``, ``load_sharded_state_dict`` validates it
and only then restores, ``prune_to_checkpoint`` fits a load target to an older format,
``to_torch_state_dict`` / ``from_torch_state_dict`` torch's layout, ``materialize_optimizer_state``,
``OptimizerStateful``. ``_errors`` the layer's exceptions; ``_inspect_checkpoint``
(``inspect_checkpoint``) what a checkpoint holds, read without loading it; ``_cli`` the command line
(``python -m mfsdp_optim.checkpoint inspect DIR``); ``seam`` what the wrapper layer and the
benchmarks need beyond the public functions. Recipes: docs/checkpoint.md and docs/concepts.md, "The
checkpoint layer's calls". Layers it may import: ``_infra``.
"""

from .._infra.params import ParamRecord
from ._errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    KeyspaceError,
    RankDisagreementError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from ._inspect_checkpoint import inspect_checkpoint
from ._on_disk._async import PrepareHandle, SaveHandle
from ._on_disk._check_checkpoint import check_checkpoint, checkpoint_status
from ._on_disk._load_checkpoint import load_checkpoint
from ._on_disk._prepare_async_save import prepare_async_save
from ._on_disk._safe import SafeFileSystemReader, SafeLoadPlanner, safe_read_metadata
from ._on_disk._save_checkpoint import save_checkpoint
from ._state_dict._build_sharded_state_dict import build_sharded_state_dict
from ._state_dict._load_sharded_state_dict import load_sharded_state_dict
from ._state_dict._materialize_optimizer_state import materialize_optimizer_state
from ._state_dict._prune_to_checkpoint import prune_to_checkpoint
from ._state_dict._stateful import OptimizerStateful
from ._state_dict._torch_state_dict import from_torch_state_dict, to_torch_state_dict

# the wrapper layer's interface (``optim._checkpointing``), also in ``seam``: not public API
from .seam import GroupMetaTable, OptimizerStateDict, load_sharded_state_dicts  # noqa: F401

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
