"""Reading DCP checkpoints without running code from them.

Map: ``safe_read_metadata`` unpickles ``.metadata`` through an allow-list (DCP's metadata
classes, ``torch.Size``, dtypes, paths, ``OrderedDict``); ``SafeFileSystemReader`` a
``FileSystemReader`` reading metadata that way; ``SafeLoadPlanner`` a ``DefaultLoadPlanner``
loading non-tensor items with ``weights_only=True`` (plus ``builtins.tuple``, which the format-3
table pickles through); ``UnsafeCheckpointError`` / ``raise_unsafe`` what a refusal raises.
Use: ``dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())``,
as ``load_checkpoint`` does. What torch unpickles unrestricted: docs/reliability.md, "Security".
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .._errors import UnsafeCheckpointError

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "raise_unsafe",
    "safe_read_metadata",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str] | None] = {
    # module -> allowed names (None: every class the module itself defines)
    _DCP_METADATA: None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout)
        ):
            return getattr(torch, name)
        allowed = _ALLOWED.get(module, set())
        if allowed is None:
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif name in allowed:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._where}: refused to unpickle {module}.{name}: a DCP .metadata file holds "
            "only torch.distributed.checkpoint metadata classes, torch.Size, dtypes and paths. "
            "This file was not written by torch.distributed.checkpoint (or was tampered with); "
            "do not load it with torch's own reader either, which would run it."
        )


def safe_read_metadata(path: str | os.PathLike) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory ``path``, unpickled with the allow-list.

    Args:
        path: The DCP checkpoint directory (the one holding ``.metadata``).

    Returns:
        The checkpoint's ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        FileNotFoundError: There is no ``.metadata``.
        UnsafeCheckpointError: It references anything outside the allow-list (or unpickles to
            something other than DCP ``Metadata``).
        pickle.UnpicklingError: It is not a pickle (truncated, another format).
        EOFError: Likewise (a truncated file).
        ValueError: Likewise (another format).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(os.fspath(path), ".metadata")
    with open(file, "rb") as f:
        md = _MetadataUnpickler(f, file).load()
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{file}: holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list (tensor data is
    read as torch does, ``weights_only=True``).

    Args:
        path: The checkpoint directory.
        metadata: The ``Metadata`` already read from ``path`` with ``safe_read_metadata()`` (it
            is then not read again; ``load_checkpoint`` passes the one it verified).
        **kwargs: Passed to ``FileSystemReader``.
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Any = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._mfsdp_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        if rank is not None:  # per-rank metadata of a no-collectives save
            raise NotImplementedError("per-rank .metadata files are not supported here")
        md = self._mfsdp_metadata
        if md is None:
            md = safe_read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``torch.load(weights_only=True)``.

    Plain numbers, strings, tuples, lists, dicts and tensors load; any other object raises
    ``UnsafeCheckpointError`` (torch's default planner would have run it).

    Args:
        flatten_state_dict: As for ``DefaultLoadPlanner``: flatten nested dicts to DCP's
            dotted keys (default True).
        flatten_sharded_tensors: As for ``DefaultLoadPlanner`` (default True).
        allow_partial_load: As for ``DefaultLoadPlanner``: keys of the state dict missing from
            the checkpoint are left as they are instead of raising (default False).
    """

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            with torch.serialization.safe_globals([tuple]):  # the format-3 table's __reduce__
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            detail = str(exc).strip().splitlines()
            why = next((ln for ln in detail if "GLOBAL" in ln or "global" in ln), detail[-1:])
            raise UnsafeCheckpointError(
                f"refused to unpickle the non-tensor checkpoint item "
                f"{read_item.dest_index.fqn!r} with weights_only=True: {why}. It holds an "
                "object other than plain numbers, strings, containers or tensors; torch's default "
                "planner would have run it."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def raise_unsafe(exc: BaseException) -> None:
    """Re-raise the ``UnsafeCheckpointError`` that DCP wrapped in a CheckpointException (on
    any rank), so callers see the refusal rather than DCP's wrapper; otherwise return."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, UnsafeCheckpointError):
            raise UnsafeCheckpointError(f"{inner} (rank {rank})") from None
