"""The structure rules of issue 48, measured on the tree; each rule's DEBT is its open work.

The rules (stdlib ``ast`` only: no module of the package or of benchmarks/ is imported):

1. No import cycle among the package's modules. Edges come from top-level, deferred (inside a
   function) and ``TYPE_CHECKING`` imports alike: an import moved into a function hides a cycle
   from ``test_imports.py`` but the two modules still need each other.
2. No module reads or writes another object's private attribute: ``x._name`` (also
   ``getattr``/``setattr``/``hasattr``/``delattr(x, "_name")`` and ``attrgetter("_name")``)
   where ``x`` is not ``self``/``cls``, ``_name`` is not defined in the reading file and is
   defined by a module or class of the package in another module (so torch's own internals,
   ``DTensor._local_tensor``, ``torch._C``, ``distributed_c10d._world``, pass: the package
   defines none of them). ``self._name`` counts where ``_name`` is defined only in another module
   (a base class's field read by a subclass elsewhere). Over src/ and over benchmarks/,
   scripts/, examples/ (there: reads of the package's objects).
3. At most 12 modules (``.py`` files, ``__init__`` included) in each folder of the package.
4. At most 80 lines of code per function: from its ``def`` line to its last line, the
   docstring excluded (a public entry point keeps its Args/Raises). Triton kernel builders are
   exempt: a function decorated with a ``*jit*`` name, or one that defines such a function.
5. benchmarks/, scripts/ and examples/ import no private module of the package (no path
   component below ``mfsdp_optim`` that starts with ``_``); what they need from inside a layer
   comes through that layer's public names or its ``seam``.
6. Every module of a sub-package is named in its folder's Map (the ``__init__`` docstring): its
   name as written (``_engine``, ``_engine.py``); a sub-package by its folder's name in the Map
   of the folder above; an implementation module ``_x`` beside a public module ``x`` is named by
   ``x``. The root package is exempt (its docstring is the package's one-line summary; its
   sub-packages are the layers that docs/internals.md draws).

The ratchet: each rule's DEBT holds the findings a rule tolerates, keyed by file and name (never a
line number). All are empty: issue 48 brought every rule to zero, so any finding fails (the
message says how to fix it). Should a rule ever be tightened before the tree meets it, its
findings go into DEBT, which then only shrinks: a DEBT entry that no longer occurs fails too,
counts are exact, except a long function's length, which is a ceiling. A module moved by a
rename carries its entries: rename their keys in the same commit.
"""

from __future__ import annotations

import ast
import collections
import os
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _import_paths import absolute_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
PKG = "mfsdp_optim"
TOOLS = ("benchmarks", "scripts", "examples")
LAYERS = ("_infra", "stats", "optim", "checkpoint", "integrations")  # as test_layers.py
MAX_MODULES = 12
MAX_LINES = 80

# -- tolerated findings: none since issue 48 (only ever deleted from or lowered) ---------------

# rule 1: the modules of each import cycle (names below mfsdp_optim)
CYCLE_DEBT: set[tuple[str, ...]] = set()

# rule 2, src/: (file below src/mfsdp_optim, the access as written) -> occurrences
PRIVATE_ACCESS_DEBT: dict[tuple[str, str], int] = {}

# rule 2, benchmarks/ scripts/ examples/: (file, the access as written) -> occurrences
TOOLS_PRIVATE_ACCESS_DEBT: dict[tuple[str, str], int] = {}

# rule 3: folder below src/ -> modules in it
FOLDER_DEBT: dict[str, int] = {}

# rule 4: (file below src/mfsdp_optim, function's qualified name) -> lines of code (a ceiling)
LONG_FUNCTION_DEBT: dict[tuple[str, str], int] = {}

# rule 5: (file, the private module or name imported) -> occurrences
TOOLS_PRIVATE_IMPORT_DEBT: dict[tuple[str, str], int] = {}

# rule 6: modules (a sub-package: its folder) that their folder's Map does not name
MAP_DEBT: set[str] = set()


# -- the tree ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One parsed file: ``name`` its module name (``mfsdp_optim.x.y``) or, outside the package,
    its path; ``path`` the path shown in messages and DEBT keys."""

    name: str
    path: str
    is_package: bool
    tree: ast.Module


def _walk_py(root: str) -> Iterator[str]:
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(base, f)


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), path)


_CACHE: dict[str, list[Source]] = {}


def package_sources() -> list[Source]:
    """Every module of src/mfsdp_optim, parsed once per session."""
    if "src" not in _CACHE:
        out = []
        for path in _walk_py(os.path.join(SRC, PKG)):
            rel = os.path.relpath(path, SRC)
            is_package = os.path.basename(path) == "__init__.py"
            name = rel[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")
            shown = os.path.relpath(path, os.path.join(SRC, PKG)).replace(os.sep, "/")
            out.append(Source(name, shown, is_package, _parse(path)))
        _CACHE["src"] = out
    return _CACHE["src"]


def tool_sources() -> list[Source]:
    """Every file of benchmarks/, scripts/, examples/, parsed once per session."""
    if "tools" not in _CACHE:
        out = []
        for folder in TOOLS:
            for path in _walk_py(os.path.join(REPO, folder)):
                shown = os.path.relpath(path, REPO).replace(os.sep, "/")
                out.append(Source(shown, shown, False, _parse(path)))
        _CACHE["tools"] = out
    return _CACHE["tools"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _import_kinds(tree: ast.Module) -> dict[int, str]:
    """id of each import node -> "top", "deferred" (inside a function) or "typing"."""
    kinds = {id(n): "top" for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for fn in _functions(tree):
        for n in ast.walk(fn):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                kinds[id(n)] = "deferred"
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for m in ast.walk(n):
                if isinstance(m, (ast.Import, ast.ImportFrom)):
                    kinds[id(m)] = "typing"
    return kinds


# -- rule 1: import cycles ---------------------------------------------------------------------


def import_edges(sources: Iterable[Source]) -> dict[str, dict[str, tuple[int, str]]]:
    """module -> {imported module of the package: (line, kind)}; ``from P import n`` goes to
    ``P.n`` when that is a module, else to ``P``; of several imports the strongest kind is kept
    (top > deferred > typing)."""
    sources = list(sources)
    names = {s.name for s in sources}
    rank = {"top": 0, "deferred": 1, "typing": 2}
    edges: dict[str, dict[str, tuple[int, str]]] = {s.name: {} for s in sources}
    for s in sources:
        kinds = _import_kinds(s.tree)
        for node in ast.walk(s.tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(s.name, s.is_package, node)
                targets = [f"{base}.{a.name}" for a in node.names]
                targets = [t if t in names else base for t in targets]
            else:
                continue
            for target in targets:
                while target not in names and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target not in names or target == s.name:
                    continue
                kind = kinds[id(node)]
                known = edges[s.name].get(target)
                if known is None or rank[kind] < rank[known[1]]:
                    edges[s.name][target] = (node.lineno, kind)
    return edges


def import_cycles(edges: dict[str, dict[str, tuple[int, str]]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


# -- rule 2: private attributes of another module's object -------------------------------------


def private_definitions(sources: Iterable[Source]) -> dict[str, set[str]]:
    """Private name -> the files (``Source.path``) that define it: a module-level or class-level
    name (assigned or annotated, a def or class; an import is not a definition), a method or
    nested def, an attribute a method stores on ``self``/``cls`` (``self._x = ...``,
    ``setattr(self, "_x", ...)``, ``__slots__``)."""
    defined: dict[str, set[str]] = collections.defaultdict(set)
    for s in sources:
        for name in _defined_in(s.tree):
            defined[name].add(s.path)
    return defined


def _defined_in(tree: ast.Module) -> Iterator[str]:
    """The private names a file defines (see ``private_definitions``)."""
    scopes: list[ast.AST] = [tree]
    while scopes:  # module and class bodies: their plain names are attributes
        scope = scopes.pop()
        for stmt in _flat_body(scope):
            if isinstance(stmt, ast.ClassDef):
                scopes.append(stmt)
            for target in _bound_names(stmt):
                if _private(target):
                    yield target
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if _private(node.name):
                yield node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _is_self(node.value) and _private(node.attr):
                yield node.attr
        elif isinstance(node, ast.Call) and _call_name(node) == "setattr":
            name = _string_arg(node, 1)
            if name and node.args and _is_self(node.args[0]) and _private(name):
                yield name


def _flat_body(scope: ast.AST) -> Iterator[ast.stmt]:
    """The statements of a module or class body, those under if/try/with/for included."""
    todo = list(getattr(scope, "body", []))
    while todo:
        stmt = todo.pop()
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                todo += getattr(stmt, field, [])
            for handler in getattr(stmt, "handlers", []):
                todo += handler.body


def _bound_names(stmt: ast.stmt) -> Iterator[str]:
    """Names a statement defines in its scope (an import defines nothing: it names what
    another module defines)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield stmt.name
    elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for target in targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    yield n.id
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets
        ):
            for e in ast.walk(stmt.value):
                if isinstance(e, ast.Constant) and isinstance(e.value, str):
                    yield e.value
    elif isinstance(stmt, ast.With):
        for item in stmt.items:
            if item.optional_vars is not None:
                yield from (n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _string_arg(node: ast.Call, i: int) -> str | None:
    if len(node.args) > i:
        arg = node.args[i]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def _external_roots(s: Source) -> set[str]:
    """Names bound by imports of modules outside the package (torch, dist, triton, ...)."""
    roots = set()
    for node in ast.walk(s.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != PKG:
                    roots.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = (
                absolute_module(s.name, s.is_package, node) if node.level else node.module or ""
            )
            if target.split(".")[0] != PKG:
                roots.update(a.asname or a.name for a in node.names)
    return roots


def _root(expr: ast.AST) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


_ACCESSORS = {"getattr": "read", "hasattr": "read", "setattr": "write", "delattr": "write"}


def _private_uses(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.AST | None, str, str]]:
    """(node, the object or None, private attribute, "read"/"write") of every private access."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            write = isinstance(node.ctx, (ast.Store, ast.Del))
            yield node, node.value, node.attr, "write" if write else "read"
        elif isinstance(node, ast.Call) and _call_name(node) in _ACCESSORS:
            name = _string_arg(node, 1)
            if name and _private(name):
                yield node, node.args[0], name, _ACCESSORS[_call_name(node)]
        elif isinstance(node, ast.Call) and _call_name(node) == "attrgetter":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    name = arg.value.split(".")[0]
                    if _private(name):
                        yield node, None, name, "read"


@dataclass(frozen=True)
class Access:
    path: str
    line: int
    text: str  # the access as written: ``w._engines``, ``self._engines`` (inherited)
    kind: str  # "read" / "write"
    owners: tuple[str, ...]  # the files that define the attribute

    @property
    def key(self) -> tuple[str, str]:
        return self.path, self.text


def private_accesses(readers: Iterable[Source], defined: dict[str, set[str]]) -> list[Access]:
    """Rule 2 over ``readers``: each access to a private attribute that only other files define
    (``self._x`` included: a base class's field, defined in another module)."""
    found = []
    for s in readers:
        external = _external_roots(s)
        own = set(_defined_in(s.tree))
        for node, value, attr, kind in _private_uses(s.tree):
            owners = defined.get(attr, set()) - {s.path}
            if attr in own or not owners:
                continue  # this file's own attribute, or none of the package's (torch's)
            if value is not None and _root(value) in external:
                continue  # ``torch._C``, ``dist.distributed_c10d._world``: not the package's
            text = ast.unparse(value) if value is not None else "attrgetter(...)"
            owners_ = tuple(sorted(owners))
            found.append(Access(s.path, node.lineno, f"{text}.{attr}", kind, owners_))
    return found


def private_name_imports(sources: Iterable[Source]) -> list[Access]:
    """Rule 2's other form: ``from .other import _name`` (a private name, not a module, of
    another module of the same layer; across layers ``test_layers.py`` refuses it already)."""
    sources = list(sources)
    path_of = {s.name: s.path for s in sources}
    found = []
    for s in sources:
        for node in ast.walk(s.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = absolute_module(s.name, s.is_package, node)
            if target not in path_of or target == s.name or _other_layer(s.name, target):
                continue
            for a in node.names:
                if _private(a.name) and f"{target}.{a.name}" not in path_of:
                    shown = "." * node.level + (node.module or "")
                    text = f"from {shown} import {a.name}"
                    found.append(Access(s.path, node.lineno, text, "read", (path_of[target],)))
    return found


def _other_layer(module: str, target: str) -> bool:
    """Both in layer packages, different ones (the imports ``test_layers.py`` checks)."""
    a, b = (name.split(".")[1] if name.count(".") else "" for name in (module, target))
    return a != b and a in LAYERS and b in LAYERS


# -- rule 3: modules per folder ----------------------------------------------------------------


def crowded_folders(sources: Iterable[Source], limit: int = MAX_MODULES) -> dict[str, int]:
    """Folder (``mfsdp_optim/...``) -> its modules, for each folder of more than ``limit``."""
    per_folder = collections.Counter("/".join([PKG, *s.path.split("/")[:-1]]) for s in sources)
    return {folder: n for folder, n in per_folder.items() if n > limit}


# -- rule 4: long functions --------------------------------------------------------------------


def _is_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if "jit" in ast.unparse(target).lower():
            return True
    return False


def _builds_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel builder: decorated with a ``*jit*`` name, or defines such a function."""
    return any(_is_jit(f) for f in _functions(fn))


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the ``def`` line to the last line (decorators out), the docstring excluded."""
    assert fn.end_lineno is not None
    n = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        n -= first.end_lineno - first.lineno + 1
    return n


def long_functions(tree: ast.Module, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, line, lines of code) of each function over ``limit``, kernel builders
    left out; methods are ``Class.name``, nested functions ``outer.inner``."""
    found = []
    todo: list[tuple[ast.AST, str]] = [(tree, "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = prefix + child.name
                n = code_lines(child)
                if n > limit and not _builds_kernel(child):
                    found.append((qualname, child.lineno, n))
                todo.append((child, qualname + "."))
            elif isinstance(child, ast.ClassDef):
                todo.append((child, prefix + child.name + "."))
            else:
                todo.append((child, prefix))
    return sorted(found)


# -- rule 5: private imports from the tools ----------------------------------------------------


def private_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted name) of each private module or name of the package a file imports:
    ``import``, ``from ... import`` (inside functions too) and ``import_module("...")``."""
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and _call_name(node) in ("import_module", "__import__"):
            name = _string_arg(node, 0)
            targets = [name] if name else []
        for target in targets:
            parts = target.split(".")
            if parts[0] == PKG and any(_private(p) for p in parts[1:]):
                found.append((node.lineno, target))
    return found


# -- rule 6: every module named in its folder's Map --------------------------------------------


def unnamed_in_maps(sources: Iterable[Source]) -> set[str]:
    """Modules (``x/_y.py``; a sub-package as ``x/_y/``) their folder's Map does not name."""
    sources = list(sources)
    maps = {
        s.path.rpartition("/")[0]: ast.get_docstring(s.tree) or "" for s in sources if s.is_package
    }
    paths = {s.path for s in sources}
    unnamed = set()
    for s in sources:
        inner = s.path.rpartition("/")[0] if s.is_package else s.path
        folder, _, stem = inner.rpartition("/")
        stem = stem.removesuffix(".py")
        if not folder:
            continue  # the root's modules and the layers themselves (docs/internals.md)
        if stem in ("__init__", "__main__"):
            continue
        doc = maps.get(folder, "")
        public = stem.startswith("_") and f"{folder}/{stem[1:]}.py" in paths
        if not _named(stem, doc) and not (public and _named(stem[1:], doc)):
            unnamed.add(f"{inner}/" if s.is_package else inner)
    return unnamed


def _named(stem: str, doc: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(stem)}(?!\w)", doc) is not None


# -- the ratchet -------------------------------------------------------------------------------


def ratchet(
    debt_name: str, debt: dict[Any, int], found: dict[Any, int], rule: str, fix: str
) -> list[str]:
    """The problems of ``found`` (key -> count) against ``debt`` (key -> count, exact)."""
    problems = []
    for key in sorted(set(found) | set(debt), key=repr):
        now, then = found.get(key, 0), debt.get(key, 0)
        if now > then:
            times = f" x{now} (DEBT allows {then})" if then else f" x{now}" if now > 1 else ""
            problems.append(f"{rule}: {key!r}{times}. {fix}")
        elif now < then:
            what = f"lower it to {now}" if now else "delete the entry"
            problems.append(
                f"{debt_name}[{key!r}] is {then} but the tree has {now}: {what} (the DEBT "
                f"list only shrinks; thank you)"
            )
    return problems


def _report(problems: list[str], details: Iterable[str] = ()) -> None:
    if problems:
        pytest.fail("\n".join(problems + (["", "where:"] + list(details) if details else [])))


# -- the tests ---------------------------------------------------------------------------------


def test_the_walk_finds_the_tree():
    names = {s.name for s in package_sources()}
    assert {"mfsdp_optim", "mfsdp_optim.optim", "mfsdp_optim.stats._reduce"} <= names
    assert len(names) > 60, len(names)
    tools = {s.path for s in tool_sources()}
    assert "benchmarks/bench_stats.py" in tools and "scripts/conformance.py" in tools


def test_no_import_cycle():
    edges = import_edges(package_sources())
    cycles = {tuple(m.removeprefix(PKG + ".") for m in c): c for c in import_cycles(edges)}
    new = [c for c in cycles if c not in CYCLE_DEBT]
    # a DEBT cycle that grew into a new one is reported as the new one, not as gone
    grown = {old for old in CYCLE_DEBT for c in new if set(old) < set(c)}
    fix = (
        "A new import cycle: break it (move what both need into a lower module, or hand the "
        "object in instead of importing its module; an import inside a function or under "
        "TYPE_CHECKING is still a cycle)."
    )
    if grown:
        fix += f" It grew out of {sorted(grown)} (CYCLE_DEBT): that one must not grow either."
    details = [
        f"  {a.removeprefix(PKG + '.')}:{line} -> {b.removeprefix(PKG + '.')} ({kind})"
        for c in new
        for a in cycles[c]
        for b, (line, kind) in sorted(edges[a].items())
        if b in cycles[c]
    ]
    debt = dict.fromkeys(CYCLE_DEBT - grown, 1)
    found = dict.fromkeys(set(cycles) - grown, 1)
    _report(ratchet("CYCLE_DEBT", debt, found, "rule 1", fix), details)


def _check_accesses(accesses: list[Access], debt: dict[tuple[str, str], int], name: str):
    found = collections.Counter(a.key for a in accesses)
    fix = (
        "A private attribute of an object another module defines: ask its owner through a "
        "method or a public attribute instead (add one to the owner's class), or move the "
        "code that needs it into the owner's module."
    )
    details = [
        f"  {a.path}:{a.line} {a.kind} {a.text} (defined in {', '.join(a.owners)})"
        for a in sorted(accesses, key=lambda a: (a.path, a.line))
        if found[a.key] > debt.get(a.key, 0)
    ]
    _report(ratchet(name, debt, found, "rule 2", fix), details)


def test_no_private_attribute_of_another_module():
    sources = package_sources()
    accesses = private_accesses(sources, private_definitions(sources))
    accesses += private_name_imports(sources)
    _check_accesses(accesses, PRIVATE_ACCESS_DEBT, "PRIVATE_ACCESS_DEBT")


def test_tools_read_no_private_attribute_of_the_package():
    defined = private_definitions(package_sources())
    accesses = private_accesses(tool_sources(), defined)
    _check_accesses(accesses, TOOLS_PRIVATE_ACCESS_DEBT, "TOOLS_PRIVATE_ACCESS_DEBT")


def test_at_most_12_modules_per_folder():
    found = crowded_folders(package_sources())
    fix = (
        f"A folder of more than {MAX_MODULES} modules: split it into sub-packages by concern, "
        "each with its Map in its __init__ docstring."
    )
    _report(ratchet("FOLDER_DEBT", FOLDER_DEBT, found, "rule 3", fix))


def test_no_function_over_80_lines():
    problems = []
    seen = {}
    for s in package_sources():
        for qualname, line, n in long_functions(s.tree):
            key = (s.path, qualname)
            seen[key] = n
            ceiling = LONG_FUNCTION_DEBT.get(key)
            if ceiling is None:
                problems.append(
                    f"rule 4: {s.path}:{line} {qualname} has {n} lines of code (at most "
                    f"{MAX_LINES}, the docstring not counted). Split it into named phases, "
                    "each a function of its own."
                )
            elif n > ceiling:
                problems.append(
                    f"rule 4: {s.path}:{line} {qualname} grew from {ceiling} to {n} lines of "
                    f"code (LONG_FUNCTION_DEBT); it is over {MAX_LINES} already: split it "
                    "into named phases rather than adding to it."
                )
    for key in sorted(set(LONG_FUNCTION_DEBT) - set(seen)):
        problems.append(
            f"LONG_FUNCTION_DEBT[{key!r}] no longer occurs (at most {MAX_LINES} lines now, "
            "or renamed): delete the entry (the DEBT list only shrinks; thank you)"
        )
    _report(problems)


def test_tools_import_no_private_module():
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    lines = collections.defaultdict(list)
    for s in tool_sources():
        for line, target in private_imports(s.tree):
            found[s.path, target] += 1
            lines[s.path, target].append(line)
    fix = (
        "A private module of the package imported from outside src/: import the layer's "
        "public names or its seam (add the name to the seam's __all__ if a tool needs it)."
    )
    details = [
        f"  {k[0]}:{','.join(map(str, v))} {k[1]}"
        for k, v in sorted(lines.items())
        if found[k] > TOOLS_PRIVATE_IMPORT_DEBT.get(k, 0)
    ]
    _report(
        ratchet("TOOLS_PRIVATE_IMPORT_DEBT", TOOLS_PRIVATE_IMPORT_DEBT, found, "rule 5", fix),
        details,
    )


def test_every_module_is_named_in_its_folders_map():
    found = dict.fromkeys(unnamed_in_maps(package_sources()), 1)
    fix = (
        "A module its folder's Map does not name: add it to the Map (the folder's __init__ "
        "docstring: what it holds, in a few words), so a reader finds it from the Map alone."
    )
    _report(ratchet("MAP_DEBT", dict.fromkeys(MAP_DEBT, 1), found, "rule 6", fix))


# -- the checkers on synthetic sources: each rule can fail ---------------------------------------


def _package(files: dict[str, str]) -> list[Source]:
    """Sources of a made-up package: ``files`` maps a path below mfsdp_optim to its code."""
    out = []
    for path, code in files.items():
        is_package = path.endswith("__init__.py")
        name = ".".join([PKG, *path[: -len(".py")].split("/")]).removesuffix(".__init__")
        out.append(Source(name, path, is_package, ast.parse(textwrap.dedent(code))))
    return out


def _cycles(files: dict[str, str]) -> list[tuple[str, ...]]:
    return import_cycles(import_edges(_package(files)))


def test_the_cycle_checker_sees_every_kind_of_edge():
    one_way = {"__init__.py": "", "a.py": "from . import b\n", "b.py": "x = 1\n"}
    assert _cycles(one_way) == []
    top = {**one_way, "b.py": "from .a import f\n"}
    assert _cycles(top) == [("mfsdp_optim.a", "mfsdp_optim.b")]
    deferred = {**one_way, "b.py": "def g():\n    from . import a\n"}
    assert _cycles(deferred) == [("mfsdp_optim.a", "mfsdp_optim.b")]
    typing_ = {**one_way, "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"}
    typing_["b.py"] += "    from .a import A\n"
    assert _cycles(typing_) == [("mfsdp_optim.a", "mfsdp_optim.b")]
    # through a package's __init__, three modules long, absolute
    ring = {
        "__init__.py": "",
        "p/__init__.py": "from ._x import X\n",
        "p/_x.py": "import mfsdp_optim.q._y\n",
        "q/__init__.py": "",
        "q/_y.py": "def f():\n    from ..p import X\n",
    }
    assert _cycles(ring) == [("mfsdp_optim.p", "mfsdp_optim.p._x", "mfsdp_optim.q._y")]
    # a module's import of itself, of torch, of its own parent package: no cycle of its own
    assert _cycles({"__init__.py": "", "a.py": "import torch\nfrom . import a\n"}) == []
    edges = import_edges(_package(deferred))
    assert edges["mfsdp_optim.b"] == {"mfsdp_optim.a": (2, "deferred")}


def _accesses(files: dict[str, str]) -> list[tuple[str, str, str]]:
    sources = _package(files)
    found = private_accesses(sources, private_definitions(sources))
    found += private_name_imports(sources)
    return sorted((a.path, a.text, a.kind) for a in found)


_OWNER = """
    import torch

    _TABLE = {}

    class Engine:
        _kind: str = "x"

        def __init__(self):
            self._groups = []
            setattr(self, "_ready", True)

        def _rebuild(self):
            return self._groups
    """


def test_the_private_access_checker():
    def reader(code: str) -> list[tuple[str, str, str]]:
        return _accesses({"__init__.py": "", "owner.py": _OWNER, "reader.py": code})

    assert reader("def f(e):\n    return e._groups\n") == [("reader.py", "e._groups", "read")]
    assert reader("def f(e):\n    e.fast._groups = 1\n") == [
        ("reader.py", "e.fast._groups", "write")
    ]
    assert reader("from . import owner\nx = owner._TABLE\n") == [
        ("reader.py", "owner._TABLE", "read")
    ]
    assert reader("def f(e):\n    return getattr(e, '_ready', 0)\n") == [
        ("reader.py", "e._ready", "read")
    ]
    assert reader("def f(e):\n    setattr(e, '_kind', 'y')\n") == [
        ("reader.py", "e._kind", "write")
    ]
    assert reader("from operator import attrgetter\nk = attrgetter('_kind')\n") == [
        ("reader.py", "attrgetter(...)._kind", "read")
    ]
    # a subclass elsewhere reading its base class's field
    inherited = "from .owner import Engine\nclass E(Engine):\n    def g(self):\n"
    inherited += "        return self._groups\n"
    assert reader(inherited) == [("reader.py", "self._groups", "read")]
    assert reader("from .owner import _TABLE\n") == [
        ("reader.py", "from .owner import _TABLE", "read")
    ]
    layers = {"__init__.py": "", "stats/__init__.py": "", "stats/_a.py": "_X = 1\n"}
    layers["stats/_b.py"] = layers["optim/_c.py"] = "from ..stats._a import _X\n"
    # across layers test_layers.py refuses it
    assert _accesses(layers) == [("stats/_b.py", "from ..stats._a import _X", "read")]
    # allowed: torch's internals (the package defines none), a root imported from outside the
    # package, this file's own attribute, a private module, a public attribute
    assert reader("def f(t):\n    return t._local_tensor, t._spec\n") == []
    assert reader("import torch\nx = torch._C._groups\n") == []
    assert reader("import torch.distributed as dist\nx = dist.distributed_c10d._TABLE\n") == []
    own = "class Mine:\n    def __init__(self):\n        self._groups = 1\n"
    own += "def f(m):\n    return m._groups\n"
    assert reader(own) == []
    modules = {"__init__.py": "", "owner.py": _OWNER, "_helpers.py": "def f():\n    pass\n"}
    modules["reader.py"] = "from . import _helpers\nfrom .owner import Engine\n"
    assert _accesses(modules) == []
    # the same names in the owner's own module are not findings
    assert _accesses({"__init__.py": "", "owner.py": _OWNER + "\n    y = Engine()._groups\n"}) == []


def test_the_long_function_checker():
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    short = "def f():\n" + body  # 80 lines
    assert long_functions(ast.parse(short)) == []
    assert long_functions(ast.parse(short + "    return 1\n")) == [("f", 1, 81)]
    doc = 'def f():\n    """A docstring\n\n    of four lines.\n    """\n' + body
    assert long_functions(ast.parse(doc)) == []  # the docstring is not code
    method = "class C:\n    @property\n" + textwrap.indent(short + "    return 1\n", "    ")
    assert long_functions(ast.parse(method)) == [("C.f", 3, 81)]
    nested = "def outer():\n" + textwrap.indent(short + "    return 1\n", "    ")
    assert long_functions(ast.parse(nested)) == [("outer", 1, 82), ("outer.f", 2, 81)]
    kernel = "@triton.jit\n" + short + "    return 1\n"
    assert long_functions(ast.parse(kernel)) == []
    builder = "def build():\n    import triton\n\n" + textwrap.indent(kernel, "    ")
    assert long_functions(ast.parse(builder)) == []
    assert long_functions(ast.parse("@functools.cache\n" + short + "    return 1\n"))


def test_the_folder_checker():
    files = {f"a/m{i}.py": "" for i in range(12)}
    assert crowded_folders(_package({"__init__.py": "", "a/__init__.py": "", **files})) == {
        "mfsdp_optim/a": 13
    }
    assert crowded_folders(_package({"__init__.py": "", **files})) == {}
    nested = {f"a/b/m{i}.py": "" for i in range(13)}
    assert crowded_folders(_package({**files, **nested})) == {"mfsdp_optim/a/b": 13}


def test_the_private_import_checker():
    code = """
        import mfsdp_optim
        import mfsdp_optim.stats._fused
        from mfsdp_optim import __version__, get_grad_norm
        from mfsdp_optim.optim import _classify, FullyShardedOptimizer
        from mfsdp_optim._infra import comm
        import importlib

        def f():
            from mfsdp_optim.stats._reduce import reduce_buckets
            return importlib.import_module("mfsdp_optim.checkpoint._table")
        """
    assert private_imports(ast.parse(textwrap.dedent(code))) == [
        (3, "mfsdp_optim.stats._fused"),
        (5, "mfsdp_optim.optim._classify"),
        (6, "mfsdp_optim._infra.comm"),
        (10, "mfsdp_optim.stats._reduce.reduce_buckets"),
        (11, "mfsdp_optim.checkpoint._table"),
    ]


def test_the_ratchet_only_tightens():
    debt = {"a": 2, "b": 1}
    assert ratchet("D", debt, {"a": 2, "b": 1}, "rule", "fix") == []
    (new,) = ratchet("D", debt, {"a": 2, "b": 1, "c": 1}, "rule", "fix it")
    assert "'c'" in new and "fix it" in new
    (more,) = ratchet("D", debt, {"a": 3, "b": 1}, "rule", "fix it")
    assert "x3" in more and "allows 2" in more
    (fewer,) = ratchet("D", debt, {"a": 1, "b": 1}, "rule", "fix")
    assert "lower it to 1" in fewer
    (gone,) = ratchet("D", debt, {"a": 2}, "rule", "fix")
    assert "delete the entry" in gone and "D['b']" in gone


def test_the_map_checker():
    files = {
        "__init__.py": '"""The package: no Map needed."""',
        "errors.py": "",
        "layer/__init__.py": '"""Map: ``_engine`` the engine; ``graph.py`` replay; ``api``."""',
        "layer/__main__.py": "",
        "layer/_engine.py": "",
        "layer/graph.py": "",
        "layer/api.py": "",
        "layer/_api.py": "",  # named by the public module beside it
        "layer/_engine_extra.py": "",  # not named by ``_engine``
        "layer/_sub/__init__.py": '"""_step.py the entry point."""',
        "layer/_sub/_step.py": "",
        "layer/_sub/_plan.py": "",
    }
    assert unnamed_in_maps(_package(files)) == {
        "layer/_engine_extra.py",
        "layer/_sub/",
        "layer/_sub/_plan.py",
    }
