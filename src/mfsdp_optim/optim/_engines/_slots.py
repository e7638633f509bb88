"""The wrapper's table of the base optimizer's params: one ``Slot`` per param, in group order.

The table is the wrapper's private index over ``optimizer.param_groups``; it never changes the
groups. Built at wrap time and again whenever the groups' ``params`` lists are not the objects
(or lengths) it was built from, which is checked in O(groups) at every step.

FQNs come from the model chunks' ``named_parameters()`` with ``torch.compile``'s ``_orig_mod.``
component removed, so they match stock DCP's names; without model chunks a param is named by its
position, ``param_groups.<g>.params.<j>``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._infra.group_lists import aligned_lists
from ..._infra.params import strip_compile_prefix
from ..._infra.placement import mesh_ranks_outside_group

if TYPE_CHECKING:
    from ...stats.seam import BucketKey

__all__ = ["Slot", "SlotTable", "fqn_map"]


class Slot:
    """One param of the base optimizer and what the wrapper caches about it between steps."""

    __slots__ = (
        "fqn",
        "param",
        "group_index",
        "held",
        "work_grad",
        "saved_grad",
        "grad_spec",
        "grad_dtype",
        "bucket_key",
        "fast_list",
    )

    def __init__(self, fqn: str, param: DTensor, group_index: int, held: bool):
        self.fqn = fqn
        self.param = param
        self.group_index = group_index
        self.held = held  # False: the empty-shard filter leaves it out of the base step here
        self.work_grad: DTensor | None = None  # the grad the base step uses (while PREPARED)
        self.saved_grad: DTensor | None = None  # the original grad when work_grad is a cast copy
        # the stats bucket of the last grad seen, valid while the grad keeps this spec object
        # and dtype (FSDP2 hands every grad of a param the same spec): one identity check a step
        self.grad_spec: object = None
        self.grad_dtype: torch.dtype | None = None
        self.bucket_key: BucketKey | None = None
        # the fast step's grad list of this param's group (see _fast_step); None: not cached
        self.fast_list: list[torch.Tensor] | None = None


def fqn_map(model_chunks: Sequence[torch.nn.Module]) -> dict[int, str]:
    """id(param) -> FQN over all chunks; FQNs that collide across chunks raise ValueError."""
    by_id: dict[int, str] = {}
    owner: dict[str, int] = {}
    collisions: dict[str, list[int]] = defaultdict(list)
    for c, chunk in enumerate(model_chunks):
        for raw, param in chunk.named_parameters():
            name = strip_compile_prefix(raw)
            if name in owner and owner[name] != c:
                collisions[name].extend([owner[name], c])
                continue
            owner[name] = c
            by_id.setdefault(id(param), name)
    if collisions:
        desc = ", ".join(
            f"{n!r} (chunks {sorted(set(cs))})" for n, cs in sorted(collisions.items())
        )
        raise ValueError(
            f"model_chunks have colliding parameter FQNs: {desc}. Each FQN names one parameter "
            "in checkpoints; give the chunks distinct module names (e.g. wrap each chunk in a "
            "parent module with a unique attribute name)."
        )
    return by_id


class SlotTable:
    """The slots of every param of ``optimizer.param_groups``, validated."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_chunks: Sequence[torch.nn.Module],
        *,
        filter_empty: bool,
        stats_group: dist.ProcessGroup | None,
    ):
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.filter_empty = filter_empty
        self.stats_group = stats_group
        self.in_stats_group = dist.get_rank(stats_group) >= 0 if stats_group is not None else True
        self.slots: list[Slot] = []
        self.version = 0  # bumped at every rebuild: caches keyed on the table compare it
        self._lists: list[tuple[list, int]] = []
        self.rebuild()

    def current(self) -> bool:
        """True when the groups hold the params lists (same objects, same lengths) the table was
        built from; O(groups)."""
        groups = self.optimizer.param_groups
        lists = self._lists
        if len(groups) != len(lists):
            return False
        for g, (lst, n) in zip(groups, lists, strict=True):
            params = g["params"]
            if params is not lst or len(params) != n:
                return False
        return True

    def sync(self) -> bool:
        """Rebuild if the groups changed; returns True when it rebuilt."""
        if self.current():
            return False
        self.rebuild()
        return True

    def rebuild(self) -> None:
        """Validate every param and make the slots; on an error the table is as it was."""
        groups = self.optimizer.param_groups
        named = self._name_params(groups)
        self._check_stats_group(named)
        aligned_lists(self.optimizer)  # raises now, not inside a step, if they drifted apart
        slots = []
        for fqn, p, gi in named:
            held = not (self.filter_empty and p._local_tensor.numel() == 0)
            slots.append(Slot(fqn, p, gi, held))
        self.slots = slots
        self._lists = [(g["params"], len(g["params"])) for g in groups]
        self.version += 1

    def held_params(self, group_index: int) -> list[DTensor]:
        return [s.param for s in self.slots if s.group_index == group_index and s.held]

    def _name_params(self, groups: list[dict]) -> list[tuple[str, DTensor, int]]:
        fqns = fqn_map(self.model_chunks)
        missing: list[str] = []
        named: list[tuple[str, DTensor, int]] = []
        for g, group in enumerate(groups):
            for j, p in enumerate(group["params"]):
                if not isinstance(p, DTensor):
                    raise TypeError(
                        f"param_groups[{g}]['params'][{j}] is a {type(p).__name__}, expected a "
                        "DTensor: FullyShardedOptimizer wraps optimizers over FSDP2 (fully_shard) "
                        "params. Build the optimizer after fully_shard(model), from "
                        "model.parameters()."
                    )
                if self.model_chunks and id(p) not in fqns:
                    missing.append(
                        f"param_groups[{g}]['params'][{j}] (shape {tuple(p.shape)}, "
                        f"mesh dims {p.device_mesh.mesh_dim_names})"
                    )
                named.append((fqns.get(id(p), f"param_groups.{g}.params.{j}"), p, g))
        if missing:
            raise ValueError(
                f"{len(missing)} optimizer params are missing from model_chunks: "
                f"{'; '.join(missing)}. Pass every module whose parameters the optimizer "
                "updates in model_chunks (FQNs come from their named_parameters())."
            )
        held: dict[int, str] = {}
        names: set[str] = set()
        for fqn, p, _ in named:
            if id(p) in held:
                raise ValueError(
                    f"the optimizer already holds the parameter {held[id(p)]!r}; a parameter "
                    f"can be in one param group only (got it again as {fqn!r})."
                )
            if fqn in names:
                raise ValueError(
                    f"the optimizer holds two parameters named {fqn!r}: names key the "
                    "checkpoint, so they must be unique. Pass model_chunks so that params are "
                    "named by their FQNs."
                )
            held[id(p)] = fqn
            names.add(fqn)
        return named

    def _check_stats_group(self, named: list[tuple[str, DTensor, int]]) -> None:
        """Every rank holding a shard of a param must be in the grad-stats group."""
        group = self.stats_group
        seen: set[int] = set()
        for fqn, p, _ in named:
            mesh = p.device_mesh
            if id(mesh) in seen:
                continue
            seen.add(id(mesh))
            outside = mesh_ranks_outside_group(mesh, group)
            if outside:
                raise ValueError(
                    f"OptimizerConfig.grad_stats_group misses ranks {outside} that hold shards "
                    f"of {fqn!r} (mesh {mesh}); their grads would be left out of the norm and "
                    "the overflow check. Use a group that spans every rank holding grads "
                    "(default: WORLD)."
                )
        if named and not self.in_stats_group:
            raise ValueError(
                f"rank {dist.get_rank()} holds params but is not in "
                "OptimizerConfig.grad_stats_group; every rank holding grads must be in it."
            )
