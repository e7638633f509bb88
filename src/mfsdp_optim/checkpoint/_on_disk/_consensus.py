"""What every rank is about to save or load, agreed before DCP runs (``_infra.agreement``).

Map: ``dist_info`` / ``group_ranks``; ``agreed`` and ``gather`` (the
protocol and an object gather, a failed collective named as such); ``raise_agreed`` (one error
on every rank, its class looked up in ``KINDS``); ``signatures`` of a state dict's flat keys and
their ``sig_digest`` (what the one all-reduce compares); ``check_agreement`` (every rank's
signatures, exchanged when the digests differ) or ``check_uniform`` (the digests agreed);
``agree_on_directory``; ``unwrap_stateful`` the state dict as ``dcp.save`` saves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..._infra import agreement
from ..._infra.agreement import Failure, Verdict
from ..._infra.attempt import Attempt
from ..._infra.comm import all_gather_objects
from .._errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankDisagreementError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)

__all__ = [
    "KINDS",
    "agree_on_directory",
    "agreed",
    "collective_failed",
    "check_agreement",
    "check_uniform",
    "dist_info",
    "flat",
    "gather",
    "group_ranks",
    "raise_agreed",
    "sig_digest",
    "signatures",
    "unwrap_stateful",
]


def dist_info(group) -> tuple[int, int, bool]:
    """``(rank, world, distributed)``; ``(0, 1, False)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group), True
    return 0, 1, False


def group_ranks(group, world: int) -> list[int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return list(range(world))
    return list(dist.get_process_group_ranks(group))


def collective_failed(exc: BaseException) -> RuntimeError:
    return RuntimeError(
        "a checkpoint collective failed or timed out: some rank of the process group did not "
        "reach save_checkpoint/load_checkpoint (it died, was killed, or is running other code); "
        f"nothing was published or loaded. Cause: {type(exc).__name__}: {exc}"
    )


def agreed(outcome: Attempt | Failure | None, group, **kwargs: Any) -> Verdict:
    """Every rank's outcome agreed: ``Attempt.verdict`` of this rank's ``Attempt`` (or of a
    ``Failure``, None for none) over ``group`` (``agreement.agree``, its ``digest`` and ``detail``
    in ``kwargs``), with a failed collective named as such."""
    attempt = outcome if isinstance(outcome, Attempt) else Attempt(outcome)
    try:
        return attempt.verdict(group, **kwargs)
    except RuntimeError as exc:
        raise collective_failed(exc) from exc


def gather(obj: Any, group) -> list[Any]:
    """Every rank's ``obj`` (one object gather; ``[obj]`` without a process group)."""
    if not dist_info(group)[2]:
        return [obj]
    try:
        return all_gather_objects(obj, group)
    except RuntimeError as exc:
        raise collective_failed(exc) from exc


KINDS: dict[str, type[BaseException]] = {
    "IncompleteCheckpointError": IncompleteCheckpointError,
    "CorruptCheckpointError": CorruptCheckpointError,
    "RankDisagreementError": RankDisagreementError,
    "StateDictMismatchError": StateDictMismatchError,
    "UnsafeCheckpointError": UnsafeCheckpointError,
    "FileExistsError": FileExistsError,
    "FileNotFoundError": FileNotFoundError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def raise_agreed(verdict: Verdict | Mapping[int, Failure], what: str) -> None:
    """Raise on every rank the first failing rank's error, listing every rank's (all ranks hold
    the same verdict, or computed the same failures from the same data)."""
    failures = verdict.failures if isinstance(verdict, Verdict) else verdict
    agreement.raise_one(failures, what, KINDS)


def unwrap_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every ``Stateful`` value replaced by its ``state_dict()`` (what
    ``dcp.save`` saves of it), before the ranks agree on what they save."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def flat(state_dict: Mapping) -> dict[str, Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    out, _ = flatten_state_dict(dict(state_dict))
    return out


def _signature(value: Any, values: bool, meshes: dict[Any, tuple]) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        spec = value._spec
        m = spec.mesh
        ranks = meshes.get(id(m))
        if ranks is None:
            ranks = meshes[id(m)] = tuple(torch.as_tensor(m.mesh).flatten().tolist())
        # the placements' text, looked up by the placements themselves (equal tuples, same text)
        placed = meshes.get(spec.placements)
        if placed is None:
            placed = meshes[spec.placements] = tuple(str(p) for p in spec.placements)
        return ("dtensor", tuple(value.shape), str(value.dtype), ranks, placed)
    if isinstance(value, torch.Tensor):
        shown = value.detach().cpu().flatten().tolist() if values and value.numel() <= 16 else None
        return ("tensor", tuple(value.shape), str(value.dtype), shown)
    text = repr(value) if values else ""
    if len(text) > 200:  # shown cut short, compared whole
        text = text[:200] + "... (sha256 " + hashlib.sha256(text.encode()).hexdigest()[:16] + ")"
    return ("object", type(value).__name__, text)


def signatures(state_dict: Mapping, values: bool) -> dict[str, tuple]:
    meshes: dict[Any, tuple] = {}  # per call: mesh id -> ranks, placements -> their text
    return {k: _signature(v, values, meshes) for k, v in flat(state_dict).items()}


def sig_digest(sig: dict[str, tuple], directory: str) -> list[int]:
    """The digest of ``signatures(...)`` (key order aside) and of the directory: what ONE
    all-reduce compares. A mesh's ranks enter once per mesh, not once per key."""
    mesh_index: dict[int, int] = {}
    meshes: list[tuple] = []
    items = []
    for key in sorted(sig):
        s = sig[key]
        if s[0] == "dtensor":
            i = mesh_index.setdefault(id(s[3]), len(meshes))
            if i == len(meshes):
                meshes.append(s[3])
            s = (*s[:3], i, *s[4:])
        items.append((key, s))
    return agreement.digest(repr((items, meshes)), directory)


def check_agreement(sigs: list[dict[str, tuple]], ranks: list[int]) -> list[str]:
    """Every DTensor key emitted by exactly the ranks of its mesh, with one signature; plain
    tensors and objects equal wherever they appear (DCP keeps only one copy of those)."""
    errors: list[str] = []
    seen: dict[str, tuple[int, tuple]] = {}
    emitters: dict[str, set[int]] = {}
    for rank, sig in zip(ranks, sigs, strict=True):
        for key, s in sig.items():
            emitters.setdefault(key, set()).add(rank)
            if key not in seen:
                seen[key] = (rank, s)
            elif seen[key][1] != s:
                r0, s0 = seen[key]
                errors.append(
                    f"{key!r}: rank {r0} has {_describe(s0)}, rank {rank} has {_describe(s)}"
                )
    return errors + _coverage(((k, s, emitters[k]) for k, (_, s) in seen.items()), set(ranks))


def check_uniform(sig: dict[str, tuple], ranks: list[int]) -> list[str]:
    """``check_agreement`` when every rank holds ``sig`` (the digests agreed): only the mesh
    coverage can fail, found without a pass over the world."""
    members = set(ranks)
    return _coverage(((k, s, members) for k, s in sig.items()), members)


def _coverage(items: Iterable[tuple[str, tuple, set[int]]], members: set[int]) -> list[str]:
    """Every DTensor key emitted by exactly the ranks of its mesh in the group."""
    errors: list[str] = []
    mesh_sets: dict[int, set[int]] = {}
    for key, s, got in items:
        if s[0] != "dtensor":
            continue
        mesh = mesh_sets.get(id(s[3]))
        if mesh is None:
            mesh = mesh_sets[id(s[3])] = set(s[3])
        want = mesh & members
        if got != want:
            missing, extra = sorted(want - got), sorted(got - want)
            errors.append(
                f"{key!r}: a DTensor on mesh ranks {sorted(s[3])}, but "
                + (f"ranks {missing} do not have it" if missing else "")
                + (" and " if missing and extra else "")
                + (f"ranks {extra} outside its mesh have it" if extra else "")
                + " (a rank with a different model or optimizer state?)"
            )
    return errors


def _describe(sig: tuple) -> str:
    if sig[0] == "dtensor":
        return f"a DTensor {list(sig[1])} {sig[2]} on mesh ranks {list(sig[3])} {list(sig[4])}"
    if sig[0] == "tensor":
        return f"a tensor {list(sig[1])} {sig[2]}" + (f" = {sig[3]}" if sig[3] is not None else "")
    return f"a {sig[1]} {sig[2]}"


def agree_on_directory(paths: list[str], verb: str, nothing: str) -> None:
    """Raise on every rank unless every rank passed the same (absolute) directory."""
    if len(set(paths)) <= 1:
        return
    shown = agreement.by_value(paths, limit=8)
    raise RankDisagreementError(
        f"ranks disagree on the checkpoint directory to {verb} ({nothing}): {shown}. Every rank "
        "must pass the same path (one checkpoint holds every rank's shards); build it from "
        "values all ranks share (the step, not the rank or a per-rank timestamp)."
    )
