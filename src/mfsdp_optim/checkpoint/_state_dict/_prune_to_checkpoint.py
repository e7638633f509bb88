"""Load targets for checkpoints that hold state for only some params."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["checkpoint_format", "prune_to_checkpoint", "read_metadata"]


def read_metadata(checkpoint: Any):
    """DCP ``Metadata`` of ``checkpoint``: a directory path, a StorageReader or Metadata itself."""
    from torch.distributed.checkpoint.metadata import Metadata

    from .._on_disk._safe import safe_read_metadata

    if isinstance(checkpoint, Metadata):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such checkpoint directory")
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise FileNotFoundError(
                f"{path}: no .metadata file, so this is not a finished DCP checkpoint (the save "
                "did not complete, or the path names another directory)"
            )
        # a path is read through the allow-list reader: no code of the checkpoint's runs here
        return safe_read_metadata(path)
    return checkpoint.read_metadata()


def checkpoint_format(state_dict_metadata, fqns, prefix: str = "optimizer") -> int:
    """The layout of the optimizer saved under ``prefix``: 3 when the checkpoint holds ONE
    ``<prefix>.param_to_group_meta`` item (the current layout), 2 when it holds
    ``<prefix>.param_to_group_meta.<fqn>`` leaves (the layout after 0.1.0; any of ``fqns``),
    1 when it holds 0.1.0's ``<prefix>.param_to_group_meta.<fqn>.<name>`` entries instead;
    3 when it holds none of these (torch's layout, or no optimizer under ``prefix``)."""
    head = f"{prefix}.param_to_group_meta"
    if head in state_dict_metadata:
        return 3
    if any(f"{head}.{fqn}" in state_dict_metadata for fqn in fqns):
        return 2
    return 1 if any(k.startswith(head + ".") for k in state_dict_metadata) else 3


def prune_to_checkpoint(state_dict: dict, checkpoint: Any, *, prefix: str = "optimizer") -> dict:
    """``state_dict`` made to fit what the checkpoint holds: without the ``state`` entries of
    params the checkpoint has no state for, and in the checkpoint's layout.

    A checkpoint saved when some params had never stepped holds no ``state`` for them, and
    ``dcp.load`` refuses a target with keys the checkpoint lacks ("Missing key in checkpoint").
    Build the target with ``is_loading=True``, prune it, load it; ``load_sharded_state_dict`` then
    drops the state of those params, as they were when saved. Only whole params are pruned: a
    param whose checkpoint entry lacks some keys stays, so the load reports the mismatch.
    The target's ``param_to_group_meta`` (format 3: one table, one item) is turned into the
    checkpoint's: format 2's per-FQN leaves (one item per param; ``as_format2``) or
    0.1.0's format 1 (a dict of hyperparameters per FQN, ``step`` in ``state``; ``as_format1``),
    all of which ``load_sharded_state_dict`` accepts. Works on every layout (``state`` keyed by
    FQN); tensors are shared, the input is not mutated. Purely local: it reads the checkpoint's
    metadata on each rank that calls it, with no collective.

    Args:
        state_dict: The load target, an fsdp_dtensor optimizer state dict (what
            ``build_sharded_state_dict(..., is_loading=True)`` returned).
        checkpoint: The checkpoint: a directory path (its ``.metadata`` is read through
            ``safe_read_metadata()``, which unpickles nothing outside an allow-list), a DCP
            ``StorageReader``, or its ``Metadata`` itself.
        prefix: The key the optimizer state dict was saved under.

    Returns:
        The pruned target, in the checkpoint's layout (tensors shared with ``state_dict``).

    Raises:
        FileNotFoundError: A path that is not a directory, or has no ``.metadata`` (not a
            finished DCP checkpoint).
    """
    from ._load_sharded_state_dict import as_format1, as_format2
    from ._table import GroupMetaTable, OptimizerStateDict, as_table, is_table

    md = read_metadata(checkpoint).state_dict_metadata
    meta = state_dict.get("param_to_group_meta")
    fqns = as_table(meta).keys() if is_table(meta) else meta if isinstance(meta, dict) else ()
    fmt = checkpoint_format(md, fqns, prefix)
    if fmt == 2:
        state_dict = as_format2(state_dict)
    elif fmt == 1:
        state_dict = as_format1(state_dict)
    elif isinstance(meta, dict) and all(isinstance(v, tuple) for v in meta.values()):
        # a format-2 target for a format-3 checkpoint: one table (dcp.load replaces it whole)
        state_dict = {**state_dict, "param_to_group_meta": GroupMetaTable.from_leaves(meta)}
    kept = {}
    for fqn, entry in state_dict["state"].items():
        if any(f"{prefix}.state.{fqn}.{key}" in md for key in entry):
            kept[fqn] = entry
    return OptimizerStateDict({**state_dict, "state": kept})
