"""mfsdp_optim.checkpoint: fsdp_dtensor optimizer state dicts that reshard, interoperate with
torch's ``get_optimizer_state_dict`` layout and never half-load.

Save::

    sd = build_sharded_state_dict(base_optimizer, records)        # one collective
    dcp.save({"optimizer": sd}, checkpoint_id=path)

Load (any world size or mesh layout)::

    sd = build_sharded_state_dict(base_optimizer, records, is_loading=True)
    sd = prune_to_checkpoint(sd, path)           # only if some params had no state when saved
    dcp.load({"optimizer": sd}, checkpoint_id=path)
    load_sharded_state_dict(base_optimizer, records, sd)          # validates, then restores

A checkpoint stock torch wrote (``get_optimizer_state_dict`` + ``dcp.save``)::

    osd = to_torch_state_dict(build_sharded_state_dict(opt, records, is_loading=True))
    dcp.load({"optimizer": osd}, checkpoint_id=path)
    load_sharded_state_dict(opt, records, from_torch_state_dict(osd))

``FullyShardedOptimizer.sharded_state_dict`` / ``load_state_dict`` call these.
"""

from ._build import KeyspaceError, build_sharded_state_dict
from ._inspect import inspect_checkpoint
from ._interop import from_torch_state_dict, to_torch_state_dict
from ._load import StateDictMismatchError, load_sharded_state_dict
from ._materialize import materialize_optimizer_state
from ._prune import prune_to_checkpoint
from ._stateful import OptimizerStateful

__all__ = [
    "KeyspaceError",
    "OptimizerStateful",
    "StateDictMismatchError",
    "build_sharded_state_dict",
    "from_torch_state_dict",
    "inspect_checkpoint",
    "load_sharded_state_dict",
    "materialize_optimizer_state",
    "prune_to_checkpoint",
    "to_torch_state_dict",
]
