"""The rule that keeps every CUDA test selectable: a test that touches CUDA carries the ``cuda``
marker (``-m cuda`` selects it, a run without a device skips it: ``tests/conftest.py``), and
collection fails when one does not (``require_cuda_marker``, called by the conftest).

A test *touches CUDA* when, read from its module's source (``ast``, nothing is run):

1. it **asks for a CUDA device**: a call with ``"cuda"`` or ``"cuda:N"`` as an argument
   (``torch.device("cuda")``, ``x.to("cuda")``, ``device="cuda"``, ``init_device_mesh("cuda",
   ...)``), a ``.cuda()`` call, or a call of ``torch.cuda.<fn>`` other than the queries
   ``is_available``, ``device_count`` and ``is_initialized``;
2. it **skips without CUDA**: a ``skipif`` whose condition mentions CUDA (on the test, its class
   or its module's ``pytestmark``), or an ``if`` whose condition mentions CUDA and whose branch
   calls ``pytest.skip`` (in the test, or at module level);
3. or it is the case of a parametrized test whose parameter is a CUDA device (``"cuda"``,
   ``"cuda:N"``, a ``torch.device`` of type cuda): only that case must carry the marker
   (``pytest.param("cuda", marks=pytest.mark.cuda)``).

Rules 1 and 2 read the test's body and, transitively, the module-level functions of its module
that it names (called, or passed on: ``ranks(2).run(_rank_fn)``). A branch under an ``if`` whose
condition mentions CUDA (``if device == "cuda":``, ``if torch.cuda.is_available():``) is a
conditional CUDA path and is not read for rule 1: the test also runs without a device. *Mentions
CUDA*: an attribute ``cuda`` or ``is_cuda``, a name containing ``cuda`` (any case), or a CUDA
device string. Helpers in other modules (``tests/_*.py``) are not followed.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "cuda_findings", "require_cuda_marker", "scan_module", "untagged_cuda_tests"]

_DEVICE = re.compile(r"cuda(:\d+)?")
_QUERIES = frozenset({"is_available", "device_count", "is_initialized"})


def _is_device_string(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _DEVICE.fullmatch(node.value) is not None
    )


def _mentions_cuda(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in ("cuda", "is_cuda"):
            return True
        if isinstance(sub, ast.Name) and "cuda" in sub.id.lower():
            return True
        if _is_device_string(sub):
            return True
    return False


def _is_call_to(node: ast.AST, name: str) -> bool:
    """``node`` calls ``name`` or ``<anything>.name``."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def _skipif_on_cuda(node: ast.AST) -> int | None:
    """The line of a ``skipif(...)`` inside ``node`` whose condition mentions CUDA, or None."""
    for sub in ast.walk(node):
        if _is_call_to(sub, "skipif"):
            assert isinstance(sub, ast.Call)
            cond = sub.args[0] if sub.args else None
            for kw in sub.keywords:
                if kw.arg == "condition":
                    cond = kw.value
            if cond is not None and _mentions_cuda(cond):
                return sub.lineno
    return None


def _calls_skip(nodes: Iterable[ast.AST]) -> bool:
    return any(_is_call_to(sub, "skip") for node in nodes for sub in ast.walk(node))


@dataclass
class Finding:
    """Why a piece of code touches CUDA: ``what`` at ``line`` of its module."""

    line: int
    what: str


@dataclass
class _Body:
    """What one function's body (or a module's top level) does: its own findings and the names
    it refers to outside the conditional CUDA branches."""

    findings: list[Finding] = field(default_factory=list)
    names: set[str] = field(default_factory=set)


class _Reader(ast.NodeVisitor):
    def __init__(self) -> None:
        self.body = _Body()

    def visit_If(self, node: ast.If) -> None:
        self._conditional(node, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._conditional(node, [node.body], [node.orelse])

    def _conditional(self, node: ast.If | ast.IfExp, body: list, orelse: list) -> None:
        if not _mentions_cuda(node.test):
            self.generic_visit(node)
            return
        if _calls_skip([*body, *orelse]):
            self.body.findings.append(Finding(node.lineno, "skips without CUDA (if ...: skip)"))
        # a conditional CUDA path: neither branch is read (the test runs without a device too)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        what = None
        if isinstance(func, ast.Attribute) and func.attr == "cuda":
            what = "calls .cuda()"
        elif (
            isinstance(func, ast.Attribute)
            and func.attr not in _QUERIES
            and (
                (isinstance(func.value, ast.Attribute) and func.value.attr == "cuda")
                or (isinstance(func.value, ast.Name) and func.value.id == "cuda")
            )
        ):
            what = f"calls cuda.{func.attr}()"
        elif any(_is_device_string(a) for a in [*node.args, *(k.value for k in node.keywords)]):
            what = "asks for a CUDA device (a 'cuda' argument)"
        if what is not None:
            self.body.findings.append(Finding(node.lineno, what))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.body.names.add(node.id)


def _read(nodes: Sequence[ast.AST]) -> _Body:
    reader = _Reader()
    for node in nodes:
        reader.visit(node)
    return reader.body


@dataclass
class ModuleScan:
    """One test module, read once: its module-wide findings (``pytestmark``, module-level skips),
    its functions by name (top level) and its classes' findings and methods."""

    module: list[Finding]
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    classes: dict[str, tuple[list[Finding], dict[str, ast.FunctionDef | ast.AsyncFunctionDef]]]
    _bodies: dict[int, _Body] = field(default_factory=dict)

    def body_of(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> _Body:
        body = self._bodies.get(id(fn))
        if body is None:
            body = self._bodies[id(fn)] = _read(fn.body)
        return body

    def test_findings(self, name: str, cls: str | None = None) -> list[Finding] | None:
        """Why the test ``name`` (a method of ``cls``) touches CUDA: rules 1 and 2 (empty when it
        does not); None when the module has no such function."""
        findings = list(self.module)
        if cls is not None:
            if cls not in self.classes:
                return None
            class_findings, methods = self.classes[cls]
            findings += class_findings
            fn = methods.get(name)
        else:
            fn = self.functions.get(name)
        if fn is None:
            return None
        findings += _decorator_findings(fn)
        seen: set[str] = set()
        todo = [fn]
        while todo:
            body = self.body_of(todo.pop())
            findings += body.findings
            for ref in sorted(body.names - seen):
                seen.add(ref)
                helper = self.functions.get(ref)
                if helper is not None and helper is not fn:
                    todo.append(helper)
        return findings


def _decorator_findings(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list:
    out = []
    for dec in node.decorator_list:
        if _is_call_to(dec, "parametrize"):  # its cases: rule 3
            continue
        line = _skipif_on_cuda(dec)
        if line is not None:
            out.append(Finding(line, "skips without CUDA (skipif)"))
    return out


def _marks_findings(stmts: Iterable[ast.stmt]) -> list[Finding]:
    """``pytestmark = ...`` skipifs on CUDA, and ``if <cuda>: pytest.skip(...)``, among
    ``stmts`` (a module's or a class's top level)."""
    out = []
    for stmt in stmts:
        targets = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            line = _skipif_on_cuda(stmt)
            if line is not None:
                out.append(Finding(line, "skips without CUDA (pytestmark skipif)"))
        elif (
            isinstance(stmt, ast.If)
            and _mentions_cuda(stmt.test)
            and _calls_skip([*stmt.body, *stmt.orelse])
        ):
            out.append(Finding(stmt.lineno, "skips without CUDA (module-level skip)"))
    return out


def scan_module(source: str) -> ModuleScan:
    tree = ast.parse(source)
    functions: dict[str, Any] = {}
    classes: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[stmt.name] = stmt
        elif isinstance(stmt, ast.ClassDef):
            methods = {
                s.name: s
                for s in stmt.body
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
            classes[stmt.name] = (_decorator_findings(stmt) + _marks_findings(stmt.body), methods)
    return ModuleScan(_marks_findings(tree.body), functions, classes)


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return _DEVICE.fullmatch(value) is not None
    return type(value).__name__ == "device" and getattr(value, "type", None) == "cuda"


def cuda_findings(item: Any, scans: dict[str, ModuleScan]) -> list[Finding]:
    """Why the collected test ``item`` touches CUDA (empty when it does not); ``scans`` caches
    each module's scan by path."""
    path = str(getattr(item, "path", "") or "")
    if not path.endswith(".py") or not hasattr(item, "originalname"):
        return []
    scan = scans.get(path)
    if scan is None:
        with open(path, encoding="utf-8") as f:
            scan = scans[path] = scan_module(f.read())
    cls = getattr(item, "cls", None)
    found = scan.test_findings(item.originalname, cls.__name__ if cls is not None else None)
    findings = list(found or [])
    callspec = getattr(item, "callspec", None)
    for name, value in callspec.params.items() if callspec is not None else ():
        if _is_cuda_device(value):
            findings.append(Finding(0, f"its parameter {name}={value!r} is a CUDA device"))
    return findings


def untagged_cuda_tests(items: Iterable[Any]) -> list[str]:
    """One line per collected test that touches CUDA without the ``cuda`` marker."""
    scans: dict[str, ModuleScan] = {}
    out = []
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            continue
        findings = cuda_findings(item, scans)
        if findings:
            rel = os.path.relpath(str(item.path))
            why = "; ".join(f"line {f.line}: {f.what}" if f.line else f.what for f in findings[:3])
            out.append(f"{rel}::{item.name}: {why}")
    return out


def require_cuda_marker(items: Iterable[Any]) -> None:
    """Collection fails (``pytest.UsageError``) when a test touches CUDA without the marker."""
    import pytest

    bad = untagged_cuda_tests(items)
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) touch CUDA without the `cuda` marker (the rule: "
            "tests/_cuda_rule.py):\n  "
            + "\n  ".join(bad[:30])
            + ("\n  ..." if len(bad) > 30 else "")
            + "\nMark each with @pytest.mark.cuda (a module: pytestmark = pytest.mark.cuda; a "
            "parametrized CUDA case: pytest.param('cuda', marks=pytest.mark.cuda)), in place of "
            "any skipif on CUDA: `-m cuda` (scripts/gpu_check.sh) then selects it, and "
            "tests/conftest.py skips it where there is no CUDA device."
        )
