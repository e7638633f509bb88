"""mfsdp_optim.checkpoint: fsdp_dtensor optimizer state dicts that reshard, interoperate with
torch's ``get_optimizer_state_dict`` layout and never half-load.

Save:

```python
records = [ParamRecord(fqn, param, opt_param), ...]          # one per trainable param
sd = build_sharded_state_dict(base_optimizer, records)        # one collective
dcp.save({"optimizer": sd}, checkpoint_id=path)
```

Load (any world size or mesh layout):

```python
sd = build_sharded_state_dict(base_optimizer, records, is_loading=True)
sd = prune_to_checkpoint(sd, path)           # only if some params had no state when saved
dcp.load({"optimizer": sd}, checkpoint_id=path)
load_sharded_state_dict(base_optimizer, records, sd)          # validates, then restores
```

A checkpoint stock torch wrote (``get_optimizer_state_dict`` + ``dcp.save``):

```python
osd = to_torch_state_dict(build_sharded_state_dict(opt, records, is_loading=True))
dcp.load({"optimizer": osd}, checkpoint_id=path)
load_sharded_state_dict(opt, records, from_torch_state_dict(osd))
```

``FullyShardedOptimizer.sharded_state_dict`` / ``load_state_dict`` call these.

Crash-safe saving and refusing damaged or untrusted checkpoints (see docs/reliability.md):

```python
save_checkpoint({"optimizer": sd}, "ckpt/step_100")   # staged, published when all finished
load_checkpoint({"optimizer": target}, "ckpt/step_100")  # verified before a byte is loaded
```
"""

from .._infra.params import ParamRecord
from ._build import KeyspaceError, build_sharded_state_dict
from ._inspect import inspect_checkpoint
from ._interop import from_torch_state_dict, to_torch_state_dict
from ._load import StateDictMismatchError, load_sharded_state_dict
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
    save_checkpoint,
)
from ._stateful import OptimizerStateful

__all__ = [
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "KeyspaceError",
    "OptimizerStateful",
    "ParamRecord",
    "RankDisagreementError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
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
    "prune_to_checkpoint",
    "safe_read_metadata",
    "save_checkpoint",
    "to_torch_state_dict",
]
