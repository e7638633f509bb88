"""Every module of the package imports on its own: an import cycle fails here, not in a user's job.

One fresh interpreter (same environment, the package's own directory first on PYTHONPATH)
imports torch and the torch.distributed modules the package uses, then forks one child per module
of src/mfsdp_optim (found by walking the tree, so a new module is covered without a test edit);
each child starts with no ``mfsdp_optim`` module loaded and imports exactly one, so the import
order is the one a user who imports that module first gets. The children's results come back as
one JSON line. An integration's implementation module (``mfsdp_optim.integrations._*``) may
instead raise the ImportError that says what to install, where its framework is missing; under
CI=true (which installs the trainers) it must import too.

And every import of the package from outside src/ resolves: benchmarks/, scripts/, examples/
and tests/ are read with ``ast`` (nothing runs; imports inside functions count, which is where
most benchmarks import the package), and each ``mfsdp_optim`` module they name must exist, and
each name they take from it must be bound at its top level (a ``TYPE_CHECKING`` name or one its
``__all__`` promises through a ``__getattr__`` counts). A module moved in src/ fails here, not in
a GPU run of a benchmark.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from _import_paths import absolute_module

# located without importing it: this process must not run the package's imports either
_SPEC = importlib.util.find_spec("mfsdp_optim")
assert _SPEC is not None and _SPEC.origin is not None, "mfsdp_optim is not importable"
PACKAGE_DIR = os.path.dirname(os.path.abspath(_SPEC.origin))

# runs in the fresh interpreter: argv[1:] are the module names
_PROBE = r"""
import json, os, sys, traceback
import torch, torch.distributed, torch.distributed.tensor, torch.distributed.checkpoint  # shared
import torch.distributed.fsdp  # noqa: the heavy, package-independent part, paid once
assert not [m for m in sys.modules if m.split(".")[0] == "mfsdp_optim"], "loaded too early"
results = {}
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            msg = "ok" if name in sys.modules else "not in sys.modules after import"
        except ImportError as exc:
            integration = name.startswith("mfsdp_optim.integrations._")
            told = integration and "Install it: pip install" in str(exc)
            msg = f"missing framework: {exc}" if told else traceback.format_exc()
        except BaseException:
            msg = traceback.format_exc()
        os.write(write, msg.encode())
        os.close(write)
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    results[name] = b"".join(chunks).decode() or f"child died (wait status {status})"
print(json.dumps(results))
"""


def _modules() -> list[str]:
    names = []
    for base, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(base, os.path.dirname(PACKAGE_DIR))
        package = rel.replace(os.sep, ".")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            stem = f[: -len(".py")]
            names.append(package if stem == "__init__" else f"{package}.{stem}")
    return names


def test_the_walk_finds_every_layer():
    names = _modules()
    for expected in (
        "mfsdp_optim",
        "mfsdp_optim.stats._math",
        "mfsdp_optim.optim",
        "mfsdp_optim.checkpoint._state_dict._table",
        "mfsdp_optim.checkpoint.__main__",
        "mfsdp_optim._infra.placement",
    ):
        assert expected in names, (expected, names)
    assert len(names) == len(set(names))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first_in_a_fresh_interpreter():
    names = _modules()
    env = dict(os.environ)
    src = os.path.dirname(PACKAGE_DIR)
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names)
    tolerated = "missing framework:" if os.environ.get("CI") != "true" else "ok"
    failed = {
        name: msg for name, msg in results.items() if msg != "ok" and not msg.startswith(tolerated)
    }
    assert not failed, "\n\n".join(f"import {n} first:\n{m}" for n, m in failed.items())


# -- every import of the package from outside src/ resolves, read statically --------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTSIDE = ("benchmarks", "scripts", "examples", "tests")


def _module_trees() -> dict[str, ast.Module]:
    """Module name -> parsed file, for every module of the package (nothing is imported)."""
    root = os.path.dirname(PACKAGE_DIR)
    trees = {}
    for name in _modules():
        rel = name.replace(".", os.sep)
        path = os.path.join(root, rel, "__init__.py")
        if not os.path.exists(path):
            path = os.path.join(root, rel + ".py")
        with open(path, encoding="utf-8") as fh:
            trees[name] = ast.parse(fh.read(), path)
    return trees


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements a module runs at import, those under if/try/with/for included (so a
    ``TYPE_CHECKING`` name counts: a lazy module's ``__getattr__`` provides it)."""
    out, todo = [], list(tree.body)
    while todo:
        stmt = todo.pop(0)
        out.append(stmt)
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                todo += getattr(stmt, field, [])
            todo += [s for h in getattr(stmt, "handlers", []) for s in h.body]
    return out


def _strings(node: ast.AST | None, assigned: dict[str, ast.AST]) -> set[str]:
    """The string constants of an ``__all__`` value, ``*NAMES`` of a module-level tuple too."""
    found: set[str] = set()
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            found.add(n.value)
        elif isinstance(n, ast.Starred) and isinstance(n.value, ast.Name):
            found |= _strings(assigned.get(n.value.id), {})
    return found


def top_level_names(name: str, trees: dict[str, ast.Module], seen: frozenset[str] = frozenset()):
    """The names module ``name`` binds at import: defs, classes, assignments, imports (a star
    import of the package's own modules followed), and, where the module has a ``__getattr__``,
    the names its ``__all__`` promises."""
    names: set[str] = set()
    assigned: dict[str, ast.AST] = {}
    for stmt in _module_level(trees[name]):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
        elif isinstance(stmt, ast.ImportFrom):
            for a in stmt.names:
                if a.name != "*":
                    names.add(a.asname or a.name)
                    continue
                source = absolute_module(name, _is_package(name, trees), stmt)
                if source in trees and source not in seen:
                    names |= top_level_names(source, trees, seen | {name})
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            if isinstance(stmt, ast.With):
                targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
            else:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                        assigned[n.id] = getattr(stmt, "value", None)
    if "__getattr__" in names:
        names |= _strings(assigned.get("__all__"), assigned)
    return names


def _is_package(name: str, trees: dict[str, ast.Module]) -> bool:
    return any(other.startswith(name + ".") for other in trees)


def unresolved_imports(tree: ast.Module, trees: dict[str, ast.Module]) -> list[tuple[int, str]]:
    """(line, what is wrong) for each import of the package in ``tree`` (inside functions too,
    and ``import_module("mfsdp_optim...")``) whose module or name does not exist."""
    names_of: dict[str, set[str]] = {}
    found = []
    for node in ast.walk(tree):
        wanted: list[tuple[str, str | None]] = []  # (module, name in it or None)
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if called == "import_module" and isinstance(arg, ast.Constant):
                wanted = [(str(arg.value), None)]
        for module, name in wanted:
            if module.split(".")[0] != "mfsdp_optim":
                continue
            if module not in trees:
                found.append((node.lineno, f"no module {module!r}"))
            elif name is not None and f"{module}.{name}" not in trees:
                if module not in names_of:
                    names_of[module] = top_level_names(module, trees)
                if name not in names_of[module]:
                    found.append((node.lineno, f"{module!r} has no name {name!r}"))
    return list(dict.fromkeys(found))  # one line per missing module, however many names


def _outside_files():
    for folder in OUTSIDE:
        for base, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(base, f)


def test_every_import_of_the_package_outside_src_resolves():
    """benchmarks/, scripts/, examples/ and tests/ (imports inside functions included: most
    benchmarks import the package in their main) name only modules and names that exist, so a
    module moved or a name renamed in src/ fails here, not in a GPU run of a benchmark."""
    trees = _module_trees()
    problems, seen = [], 0
    for path in _outside_files():
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        if "mfsdp_optim" not in source:
            continue
        seen += 1
        for line, why in unresolved_imports(ast.parse(source, path), trees):
            problems.append(f"{os.path.relpath(path, REPO)}:{line}: {why}")
    assert seen > 50, seen  # the walk found the files
    assert not problems, "imports that name what src/ does not have (update them):\n" + "\n".join(
        problems
    )


def test_the_resolver_on_a_made_up_package():
    def parse(code: str) -> ast.Module:
        return ast.parse(textwrap.dedent(code))

    trees = {
        "mfsdp_optim": parse("from .a import A\ndef __getattr__(n): ...\n__all__ = ['A', *L]\n"),
        "mfsdp_optim.a": parse(
            """
            from typing import TYPE_CHECKING
            import torch
            from ._b import *
            if TYPE_CHECKING:
                from ._b import Lazy
            try:
                X = 1
            except ImportError:
                X = None
            class A: ...
            """
        ),
        "mfsdp_optim.a._b": parse("B, (C, D) = 1, (2, 3)\ndef f(): ...\n"),
    }
    trees["mfsdp_optim"].body.insert(0, parse("L = ('Late',)").body[0])
    ok = """
        import mfsdp_optim, mfsdp_optim.a._b
        from mfsdp_optim import A, a, Late
        from mfsdp_optim.a import A, X, B, D, f, torch, Lazy, _b
        def g():
            from mfsdp_optim.a._b import C
            return importlib.import_module("mfsdp_optim.a")
        """
    assert unresolved_imports(parse(ok), trees) == []
    bad = """
        import mfsdp_optim.c
        from mfsdp_optim.a import Z, A
        from mfsdp_optim.a._b import A
        def g():
            from mfsdp_optim.a.c import A, B
            return importlib.import_module("mfsdp_optim.b")
        """
    assert unresolved_imports(parse(bad), trees) == [
        (2, "no module 'mfsdp_optim.c'"),
        (3, "'mfsdp_optim.a' has no name 'Z'"),
        (4, "'mfsdp_optim.a._b' has no name 'A'"),
        (6, "no module 'mfsdp_optim.a.c'"),
        (7, "no module 'mfsdp_optim.b'"),
    ]
    # without a __getattr__, __all__ promises nothing
    trees["mfsdp_optim"] = parse("__all__ = ['Late']\n")
    assert unresolved_imports(parse("from mfsdp_optim import Late\n"), trees) == [
        (1, "'mfsdp_optim' has no name 'Late'")
    ]
