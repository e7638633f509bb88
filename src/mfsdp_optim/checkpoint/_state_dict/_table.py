"""``param_to_group_meta`` of format 3: ONE read-only table, so ONE DCP item for every param.

Stage 3 of the build: ``GroupMetaTable.from_keyspace`` (the stage's one entry) builds the table from
the agreed ``Keyspace``, calling nothing of the other stages. Imports: the slot kinds from the leaf
``_values``; ``_keyspace``'s ``Keyspace`` for types only. The loaders, ``_torch_state_dict``,
``_prune_to_checkpoint`` and ``_inspect_checkpoint`` read tables too. The walk:
``_build_sharded_state_dict``'s map.

Map: ``GroupMetaTable`` (``table[fqn]`` a read-only ``GroupMeta`` mapping of hyperparameters and
scalar state; ``leaf``/``leaves`` the stored ``(hyperparameters, scalars)`` tuples; each distinct
tuple held once); ``TAG``/``VERSION`` its on-disk tagged tuple of builtins; ``is_table`` /
``as_table`` read either form; ``OptimizerStateDict`` turns the tuple ``dcp.load`` stores back
into a table. The table is deliberately not a ``Mapping``, so DCP stores it whole. The layout:
docs/checkpoint.md, "The layout".
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._values import PLAIN, SCALAR

if TYPE_CHECKING:
    from ._keyspace import Keyspace

__all__ = [
    "TAG",
    "VERSION",
    "GroupMeta",
    "GroupMetaTable",
    "OptimizerStateDict",
    "as_table",
    "is_table",
]

TAG = "mfsdp_optim.param_to_group_meta"
VERSION = 3

Leaf = tuple[tuple, tuple]  # (hyperparameters, scalars) of one param


class GroupMeta(Mapping):
    """One param's ``{hyperparameter: value}``, read-only: its param group's hyperparameters
    (every key but ``params``) and its scalar state (``step``; a 0-d tensor's value as a plain
    number). A scalar state key that is also a group key (apex keeps a group-level ``step``)
    shows the param's own value; ``GroupMetaTable.leaf()`` keeps both.

    ``meta["lr"]``, ``meta.items()``, ``dict(meta)``, ``==`` with a dict; assignment raises
    ``TypeError``. Pickles as a plain ``dict``.
    """

    __slots__ = ("_values",)

    def __init__(self, hyper: tuple, scalars: tuple):
        values = dict(hyper)
        values.update((key, value) for key, value, _ in scalars)
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"GroupMeta({self._values!r})"

    def __reduce__(self):
        return (dict, (dict(self._values),))


class GroupMetaTable:
    """Every param's ``(hyperparameters, scalars)`` leaf, keyed by FQN, stored deduplicated.

    Read-only: build one with ``from_leaves()`` (or ``as_table()`` of the on-disk tuple).
    ``table[fqn]`` is the param's ``GroupMeta`` (one shared object per distinct leaf) and
    raises ``KeyError`` for an FQN it does not cover; ``keys()``, ``items()``, ``values()``,
    ``get()``, iteration, ``len`` and ``in`` read like a dict of those.

    Args:
        hypers: The distinct hyperparameter tuples (sorted ``(name, plain value)`` pairs).
        scalars: The distinct scalar tuples (sorted ``(key, value, dtype name or None)``).
        index: ``{fqn: (hyper index, scalar index)}`` into those, in the table's FQN order.
    """

    __slots__ = ("_fingerprint", "_hypers", "_index", "_metas", "_scalars")

    def __init__(self, hypers: tuple, scalars: tuple, index: Mapping[str, tuple[int, int]]):
        self._hypers = tuple(hypers)
        self._scalars = tuple(scalars)
        self._index = dict(index)
        self._fingerprint: str | None = None
        self._metas: dict[tuple[int, int], GroupMeta] = {}

    @classmethod
    def from_leaves(cls, leaves: Any) -> GroupMetaTable:
        """The table of ``leaves``: a mapping or an iterable of ``(fqn, (hyperparameters,
        scalars))``, in the order given. Equal leaves are stored once; values that compare
        equal but differ in type (``1`` and ``1.0``) stay apart, so a load restores each one's
        own type."""
        pairs = leaves.items() if hasattr(leaves, "items") else leaves
        hypers: list[tuple] = []
        scalars: list[tuple] = []
        seen_h: dict[Any, int] = {}
        seen_s: dict[Any, int] = {}
        keep: list[tuple] = []  # every value looked at stays alive, so no id() is reused
        index: dict[str, tuple[int, int]] = {}
        for fqn, (hyper, scalar) in pairs:
            keep += (hyper, scalar)
            index[fqn] = (_intern(hyper, hypers, seen_h), _intern(scalar, scalars, seen_s))
        return cls(tuple(hypers), tuple(scalars), index)

    @classmethod
    def from_keyspace(cls, keyspace: Keyspace) -> GroupMetaTable:
        """Stage 3 of ``build_sharded_state_dict``: one ``(hyperparameters, scalars)`` leaf per
        FQN of ``keyspace.meta`` (the params this rank's optimizer holds when the digests agree,
        every rank's after a merge), in its order, which is the same on every rank either way;
        its scalars are the FQN's ``SCALAR`` and ``PLAIN`` slots in key order."""
        sorted_of: dict[int, tuple] = {}  # a param group's hyperparameter dict is shared: sort once
        slots_of = keyspace.state
        leaves = []
        for fqn, hyper in keyspace.meta.items():
            h = sorted_of.get(id(hyper))
            if h is None:
                h = sorted_of[id(hyper)] = tuple(sorted(hyper.items()))
            scalars = tuple(
                (k, s.value, s.dtype if s.kind == SCALAR else None)
                for k, s in slots_of.get(fqn, ())
                if s.kind == SCALAR or s.kind == PLAIN
            )
            leaves.append((fqn, (h, scalars)))
        return cls.from_leaves(leaves)

    # -- the per-FQN read-only mappings -------------------------------------------------------

    @classmethod
    def concat(cls, tables: list[GroupMetaTable]) -> GroupMetaTable:
        """One table over the disjoint FQNs of ``tables`` (several base optimizers), in order."""
        hypers: list[tuple] = []
        scalars: list[tuple] = []
        index: dict[str, tuple[int, int]] = {}
        for t in tables:
            h0, s0 = len(hypers), len(scalars)
            hypers += t._hypers
            scalars += t._scalars
            for fqn, (h, sc) in t._index.items():
                if fqn in index:
                    raise ValueError(f"param {fqn!r} is in two of the tables to concatenate")
                index[fqn] = (h0 + h, s0 + sc)
        return cls(tuple(hypers), tuple(scalars), index)

    def __getitem__(self, fqn: str) -> GroupMeta:
        return self._meta(self._index[fqn])

    def _meta(self, pos: tuple[int, int]) -> GroupMeta:
        meta = self._metas.get(pos)
        if meta is None:
            meta = self._metas[pos] = GroupMeta(self._hypers[pos[0]], self._scalars[pos[1]])
        return meta

    def get(self, fqn: str, default: Any = None) -> Any:
        """``table[fqn]``, or ``default`` for an FQN the table does not cover."""
        return self[fqn] if fqn in self._index else default

    def keys(self):
        """The FQNs, in the table's order (a read-only view)."""
        return self._index.keys()

    def items(self) -> Iterator[tuple[str, GroupMeta]]:
        """``(fqn, GroupMeta)`` pairs, in the table's order."""
        return ((fqn, self._meta(pos)) for fqn, pos in self._index.items())

    def values(self) -> Iterator[GroupMeta]:
        """The ``GroupMeta`` of every FQN, in the table's order."""
        return (self._meta(pos) for pos in self._index.values())

    # -- the stored leaves (format 2's per-FQN tuples) ---------------------------------------

    def leaf(self, fqn: str) -> Leaf:
        """The param's stored ``(hyperparameters, scalars)``: sorted ``(name, value)`` pairs and
        sorted ``(key, value, dtype name or None)`` triples. ``KeyError`` for an unknown FQN."""
        h, s = self._index[fqn]
        return self._hypers[h], self._scalars[s]

    def leaves(self) -> Iterator[tuple[str, Leaf]]:
        """``(fqn, (hyperparameters, scalars))`` pairs, in the table's order."""
        hypers, scalars = self._hypers, self._scalars
        return ((fqn, (hypers[h], scalars[s])) for fqn, (h, s) in self._index.items())

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index

    def __eq__(self, other: object) -> bool:
        """Equal to another table with the same leaves, or to a format-2 dict
        ``{fqn: (hyperparameters, scalars)}`` of the same leaves (FQN order aside)."""
        if isinstance(other, GroupMetaTable):
            if self.fingerprint() == other.fingerprint():
                return True
            other_leaves: Any = dict(other.leaves())
        elif isinstance(other, Mapping):
            other_leaves = other
        else:
            return NotImplemented
        if self.keys() != other_leaves.keys():
            return False
        return all(leaf == other_leaves[fqn] for fqn, leaf in self.leaves())

    __hash__ = None  # type: ignore[assignment]  # equal to mutable mappings: not hashable

    def __repr__(self) -> str:
        return (
            f"GroupMetaTable({len(self)} params, {len(self._hypers)} hyperparameter set(s), "
            f"{len(self._scalars)} scalar set(s), fingerprint {self.fingerprint()})"
        )

    # -- the deduplicated form ---------------------------------------------------------------

    @property
    def hypers(self) -> tuple:
        """The distinct hyperparameter tuples."""
        return self._hypers

    @property
    def scalars(self) -> tuple:
        """The distinct scalar tuples."""
        return self._scalars

    def fingerprint(self) -> str:
        """A 128-bit hex digest of the whole content (FQN order, values and their types):
        equal on two ranks iff (up to hash collisions) their tables pickle to the same bytes."""
        if self._fingerprint is None:
            text = repr((self._hypers, self._scalars, tuple(self._index.items())))
            self._fingerprint = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return self._fingerprint

    def as_tuple(self) -> tuple:
        """The on-disk form: ``(TAG, VERSION, hypers, scalars, {fqn: (h, s)})``, builtins only."""
        return (TAG, VERSION, self._hypers, self._scalars, dict(self._index))

    def __reduce__(self):
        return (tuple, (self.as_tuple(),))


def _intern(value: tuple, table: list[tuple], seen: dict[Any, int]) -> int:
    """The index of ``value`` in ``table``, appending it the first time. Keyed by identity
    first (the leaves of one param group share their tuple), then by ``repr``, not ``==``:
    ``1 == 1.0 == True`` must not merge."""
    i = seen.get(id(value))
    if i is None:
        key = repr(value)
        i = seen.get(key)
        if i is None:
            i = seen[key] = len(table)
            table.append(value)
        seen[id(value)] = i
    return i


def is_table(meta: Any) -> bool:
    """True for a format-3 ``param_to_group_meta``: a table or its on-disk tagged tuple."""
    return isinstance(meta, GroupMetaTable) or (
        isinstance(meta, tuple) and len(meta) >= 2 and meta[0] == TAG
    )


def as_table(meta: Any, where: str = "param_to_group_meta") -> GroupMetaTable:
    """``meta`` (a ``GroupMetaTable`` or its on-disk tuple, as ``dcp.load`` leaves it) as a
    table. Raises ``ValueError`` naming ``where`` and what is wrong with a malformed tuple."""
    if isinstance(meta, GroupMetaTable):
        return meta
    if not is_table(meta):
        raise ValueError(
            f"{where}: expected a GroupMetaTable or its on-disk tuple ({TAG!r}, {VERSION}, "
            f"hypers, scalars, index), got a {type(meta).__name__}"
        )
    if meta[1] != VERSION or len(meta) != 5:
        raise ValueError(
            f"{where}: a {TAG!r} table of version {meta[1]!r} with {len(meta)} fields; this "
            f"mfsdp_optim reads version {VERSION} (5 fields): upgrade mfsdp_optim to load it"
        )
    _, _, hypers, scalars, index = meta
    _check_parts(where, hypers, scalars, index)
    return GroupMetaTable(hypers, scalars, index)


def _check_parts(where: str, hypers: Any, scalars: Any, index: Any) -> None:
    if not isinstance(hypers, tuple) or not all(
        isinstance(h, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in h)
        for h in hypers
    ):
        raise ValueError(f"{where}: hyperparameters must be tuples of (name, value) pairs")
    if not isinstance(scalars, tuple) or not all(
        isinstance(s, tuple) and all(isinstance(t, tuple) and len(t) == 3 for t in s)
        for s in scalars
    ):
        raise ValueError(f"{where}: scalars must be tuples of (key, value, dtype) triples")
    if not isinstance(index, dict):
        raise ValueError(f"{where}: the index must be a dict {{fqn: (hyper, scalar)}}")
    nh, ns = len(hypers), len(scalars)
    for fqn, pos in index.items():
        if not (
            isinstance(fqn, str)
            and isinstance(pos, tuple)
            and len(pos) == 2
            and all(type(i) is int for i in pos)
            and 0 <= pos[0] < nh
            and 0 <= pos[1] < ns
        ):
            raise ValueError(
                f"{where}: index entry {fqn!r} -> {pos!r} is not (hyper index < {nh}, "
                f"scalar index < {ns})"
            )


class OptimizerStateDict(dict):
    """The fsdp_dtensor state dict: a plain ``dict`` whose ``"param_to_group_meta"`` entry,
    when set to a format-3 table's on-disk tuple (what ``dcp.load`` unpickles and stores with
    ``sd[key] = value``), holds the table again, so ``sd["param_to_group_meta"][fqn]`` reads the
    same after a load. A malformed tuple is kept as read: the loaders then say what is wrong."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key == "param_to_group_meta" and isinstance(value, tuple) and is_table(value):
            # a malformed tuple stays as read: the loaders report it with the item's name
            with contextlib.suppress(ValueError):
                value = as_table(value)
        super().__setitem__(key, value)
