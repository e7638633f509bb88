"""The layer rules, checked over src/: each layer imports only the layers its docstring allows,
and only through their packages' names, never a private module or a private name.

Each layer package's docstring (``_infra``, ``stats``, ``optim``, ``checkpoint``,
``integrations``) says
"Layers it may import: ``a``, ``b``." (or "none"). Every module under the package (nested ones
included, function-level imports included) is parsed with ``ast``; every import that resolves to
another layer must name an allowed layer, and neither the module path below that layer's package
nor an imported name may start with ``_`` (``from ..stats import grad_stats`` and ``from
..stats.seam import Buckets``, a layer's public module, are fine; ``from ..stats._buckets import
Buckets`` and ``from ..stats import _reduce`` are not; ``_infra``'s own modules are that
package's public names). No dependency: the standard library's ``ast``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

from _import_paths import absolute_module

_SPEC = importlib.util.find_spec("mfsdp_optim")
assert _SPEC is not None and _SPEC.origin is not None
PACKAGE_DIR = os.path.dirname(os.path.abspath(_SPEC.origin))
LAYERS = ("_infra", "stats", "optim", "checkpoint", "integrations")
_RULE = re.compile(r"Layers\s+it\s+may\s+import:\s*(.*?)\.(\s|$)", re.S)


def allowed_layers(docstring: str) -> set[str]:
    """The layers a package docstring's "Layers it may import: ..." sentence names."""
    match = _RULE.search(docstring)
    if match is None:
        raise AssertionError(f"no 'Layers it may import:' sentence in {docstring[:80]!r}...")
    text = " ".join(match.group(1).split())
    if text.startswith("none"):
        return set()
    return set(re.findall(r"``([\w.]+)``", text))


def violations_in(source: str, module: str, is_package: bool, layer: str, allowed: set[str]):
    """Every import of ``source`` (module ``module`` of ``layer``) that breaks the rules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [(absolute_module(module, is_package, node), [a.name for a in node.names])]
        for target, names in targets:
            parts = target.split(".")
            if parts[0] != "mfsdp_optim" or len(parts) < 2 or parts[1] not in LAYERS:
                continue
            other = parts[1]
            if other == layer:
                continue
            where = f"{module}:{node.lineno}"
            if other not in allowed:
                found.append(f"{where} imports layer {other!r} (allowed: {sorted(allowed)})")
                continue
            private = [p for p in parts[2:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if private:
                found.append(f"{where} reaches private {'.'.join(parts)} {private} of {other!r}")
    return found


def _layer_modules(layer: str):
    root = os.path.join(PACKAGE_DIR, layer)
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(base, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")]
                name = rel.replace(os.sep, ".")
                is_package = f == "__init__.py"
                yield path, name.removesuffix(".__init__"), is_package


def test_every_layer_keeps_to_its_docstring():
    problems = []
    seen = 0
    for layer in LAYERS:
        with open(os.path.join(PACKAGE_DIR, layer, "__init__.py")) as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
        allowed = allowed_layers(doc)
        assert allowed <= set(LAYERS), (layer, allowed)
        for path, name, is_package in _layer_modules(layer):
            with open(path) as fh:
                problems += violations_in(fh.read(), name, is_package, layer, allowed)
            seen += 1
    assert seen > 40, seen  # the walk found the tree
    assert not problems, "\n".join(problems)


def test_the_rules_as_the_docstrings_state_them():
    rules = {}
    for layer in LAYERS:
        with open(os.path.join(PACKAGE_DIR, layer, "__init__.py")) as fh:
            rules[layer] = allowed_layers(ast.get_docstring(ast.parse(fh.read())) or "")
    assert rules == {
        "_infra": set(),
        "stats": {"_infra"},
        "checkpoint": {"_infra"},
        "optim": {"stats", "checkpoint", "_infra"},
        # the top layer: the other layers' public names only, and nothing imports it
        "integrations": {"optim", "stats", "checkpoint"},
    }


def test_the_checker_catches_each_kind_of_breach():
    allowed = {"stats", "_infra"}

    def check(src, module="mfsdp_optim.optim._x", is_package=False):
        return violations_in(src, module, is_package, "optim", allowed)

    assert check("from ..stats import Buckets\nfrom .._infra.placement import x\n") == []
    assert check("from ..stats.seam import Buckets\n") == []  # a public module of the layer
    assert check("from ._engine import Engine\nimport torch\n") == []
    assert check("from ..stats._buckets import Buckets\n")  # a private module
    assert check("from ..stats import _reduce\n")  # a private module as a name
    assert check("def f():\n    from ..stats._reduce import x\n")  # inside a function
    assert check("import mfsdp_optim.stats._math\n")  # absolute
    assert check("from ..checkpoint import build\n")  # a layer not allowed
    assert check("from ...stats._clip import x\n", "mfsdp_optim.optim._whole._muon")  # nested
    assert check("from .._infra._secret import x\n")  # a private module of _infra
    assert check("from ..integrations import lightning\n")  # a lower layer reaching up
    assert allowed_layers("x. Layers it\n    may import: ``a``, ``b``.\n") == {"a", "b"}
    assert allowed_layers("Layers it may import: none.") == set()
