"""Every fenced ``python`` block of README.md and docs/ runs, and the site builds strictly.

A block may be preceded (blank lines aside) by an HTML comment that says how it runs; the comment
is invisible on GitHub and on the site:

``<!-- test: ranks=N -->``     run on every rank of a live N-rank gloo pool (tests/_ranks.py):
                                the default process group is already up, and torchrun's
                                variables are set (``_ranks.torchrun_env``), as under torchrun
``<!-- test: ranks=N needs=M -->``  the same where module M imports (an optional framework, e.g.
                                ``lightning``): without it the block is skipped, but under CI=true
                                (which installs the extras) that fails instead
``<!-- test: continue -->``    run together with the block before it (same page), as one program
``<!-- test: skip (why) -->``  not run; a reason is required, and such blocks are kept few

Without a comment, a block runs in this process in a fresh namespace.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FENCE_OPEN = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<what>.*?)\s*-->\s*$")
MAX_SKIPPED_FRACTION = 0.25


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None


@dataclass
class Program:
    """One or more blocks that run as one piece of code."""

    path: str
    line: int
    ranks: int | None  # None: in this process
    code: str
    lines: list[int] = field(default_factory=list)
    needs: str | None = None  # a module the block imports that may be missing


def doc_files() -> list[str]:
    files = ["README.md"]
    for base, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(".md")]
    return sorted(f for f in files if os.path.isfile(os.path.join(ROOT, f)))


def parse_blocks(rel_path: str) -> list[Block]:
    with open(os.path.join(ROOT, rel_path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks = len(m.group("indent")), m.group("ticks")
        info = m.group("info").strip().split()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{ticks}`*\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mark = MARKER.match(lines[j]) if j >= 0 else None
        blocks.append(
            Block(
                rel_path,
                start + 1,
                info[0] if info else "",
                "\n".join(body) + "\n",
                mark.group("what") if mark else None,
            )
        )
    return blocks


def _parse_marker(block: Block) -> tuple[str, int | None, str | None]:
    """('run' | 'continue' | 'skip', ranks, needs)."""
    what = (block.marker or "").strip()
    if not what:
        return "run", None, None
    if what.startswith("skip"):
        reason = what[4:].strip(" :()")
        assert reason, f"{block.path}:{block.line}: a skipped block needs a reason: skip (why)"
        return "skip", None, None
    if what == "continue":
        return "continue", None, None
    m = re.fullmatch(r"ranks=(\d+)(?:\s+needs=([\w.]+))?", what)
    assert m, f"{block.path}:{block.line}: unknown test marker {what!r}"
    return "run", int(m.group(1)), m.group(2)


def programs(rel_path: str) -> list[Program]:
    out: list[Program] = []
    for block in parse_blocks(rel_path):
        if block.lang != "python":
            continue
        kind, ranks, needs = _parse_marker(block)
        if kind == "skip":
            continue
        if kind == "continue":
            assert out, f"{block.path}:{block.line}: 'continue' with no block before it"
            out[-1].code += block.code
            out[-1].lines.append(block.line)
            continue
        out.append(Program(block.path, block.line, ranks, block.code, [block.line], needs))
    return out


def _exec(code: str, where: str) -> None:
    """Run one program in a fresh namespace (on a pool rank, or here)."""
    namespace = {"__name__": "__doc_example__"}
    exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the point of this test


def _exec_as_torchrun(code: str, where: str) -> None:
    """``_exec`` on a pool rank, in torchrun's environment."""
    from _ranks import torchrun_env

    with torchrun_env():
        _exec(code, where)


def _missing(module: str | None) -> str | None:
    """Why ``module`` cannot be imported (None: it can, or no module is needed)."""
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{module}: {exc}"
    return None


PAGES = [p for p in doc_files() if programs(p)]


def test_every_python_block_runs_or_says_why_not():
    total = skipped = 0
    for path in doc_files():
        for block in parse_blocks(path):
            if block.lang in ("py", "python3", "pycon"):
                pytest.fail(f"{path}:{block.line}: write ```python (got {block.lang!r})")
            if block.lang != "python":
                assert block.marker is None, (
                    f"{path}:{block.line}: a test marker on a non-python block"
                )
                continue
            total += 1
            skipped += _parse_marker(block)[0] == "skip"
    assert total >= 8, f"only {total} python blocks found: is the parser broken?"
    assert skipped <= MAX_SKIPPED_FRACTION * total, (
        f"{skipped} of {total} python blocks are skipped"
    )


def test_parser_sees_markers_and_continuations(tmp_path, monkeypatch):
    """The parser itself, on a page made for it (so a broken parser cannot pass silently)."""
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- test: ranks=2 -->\n\n```python\na = 1\n```\n\n"
        "<!-- test: continue -->\n```python\nb = a + 1\n```\n\n"
        "<!-- test: skip (just a picture) -->\n```python\nraise SystemExit\n```\n\n"
        "<!-- test: ranks=2 needs=some.module -->\n```python\nd = 4\n```\n\n"
        "```bash\necho hi\n```\n\n- item\n\n    ```python\n    c = 3\n    ```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    progs = programs("page.md")
    assert [(p.ranks, p.code, p.lines, p.needs) for p in progs] == [
        (2, "a = 1\nb = a + 1\n", [5, 10], None),
        (2, "d = 4\n", [20], "some.module"),
        (None, "c = 3\n", [30], None),
    ]


@pytest.mark.parametrize("page", PAGES)
def test_doc_code(page, ranks):
    """The page's blocks as the docs mean them: on CPU ranks, on any machine (the ranks see no
    GPU, so ``fully_shard`` without a mesh shards on CPU there too). Not on gloo ranks that see
    a GPU: ``fully_shard`` would put the params on CUDA, and torch's gloo backend all-gathers
    no CUDA tensors (its backend table: only all_reduce and broadcast run on GPU), so a block's
    ``full_tensor()`` kills the rank (on an H100, 2026-12-07: SIGSEGV; docs/troubleshooting.md,
    "A rank dies in full_tensor() on a GPU machine")."""
    missing = []
    for prog in programs(page):
        where = f"{prog.path}:{prog.line}"
        why = _missing(prog.needs)
        if why is not None:
            missing.append(f"{where} ({why})")
        elif prog.ranks is None:
            _exec(prog.code, where)
        else:
            pool = ranks(prog.ranks, cuda=False)
            pool.run(_exec_as_torchrun, prog.code, where, timeout=180.0)
    if missing:
        what = "not run, a module is missing: " + "; ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} (CI installs the extras: .ci/run)")
        pytest.skip(f"{what}: pip install 'mfsdp-optim[trainers]'")


PUBLIC_MODULES = (
    "mfsdp_optim",
    "mfsdp_optim.checkpoint",
    "mfsdp_optim.stats",
    "mfsdp_optim.optim",
)
REST_MARKUP = re.compile(r":(?:meth|class|func):|::\s*$", re.M)


def _public_objects() -> list[tuple[str, object]]:
    """``(qualified name, object)`` of each function and class in the public ``__all__`` lists."""
    out = []
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                out.append((f"{mod_name}.{name}", obj))
    return out


def _parameters(obj: object) -> list[str]:
    """The parameters a caller passes (``self`` excluded); ``[]`` for a class that keeps the
    constructor of a builtin base (an exception class that adds nothing)."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except ValueError:
        assert inspect.isclass(obj) and not inspect.isfunction(obj.__init__), obj
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _docstrings(obj: object) -> list[tuple[str, str]]:
    """``(where, docstring)`` of ``obj`` and, for a class, of the public members it defines."""
    out = [("", inspect.getdoc(obj) or "")]
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_") or not (
                inspect.isfunction(member)
                or isinstance(member, (property, classmethod, staticmethod))
            ):
                continue
            doc = getattr(member, "__doc__", None)
            if doc and doc is not obj.__doc__:
                out.append((f".{name}", inspect.cleandoc(doc)))
    return out


def test_public_docstrings_are_google_style():
    """Every public function and class with parameters documents them in an ``Args:`` (or, for
    a record type, ``Attributes:``) section, and no reST markup is left (mkdocstrings' Google
    parser renders ``:meth:`` roles and ``::`` literal blocks as plain text)."""
    objects = _public_objects()
    assert len(objects) >= 30, f"only {len(objects)} public objects found: is __all__ read?"
    problems = []
    for qualname, obj in objects:
        doc = inspect.getdoc(obj) or ""
        if not doc:
            problems.append(f"{qualname}: no docstring")
        sections = {line.strip() for line in doc.splitlines()}
        if _parameters(obj) and not sections & {"Args:", "Attributes:"}:
            problems.append(f"{qualname}: parameters {_parameters(obj)} but no Args: section")
        for where, text in _docstrings(obj):
            for m in REST_MARKUP.finditer(text):
                line = text[: m.start()].count("\n") + 1
                problems.append(
                    f"{qualname}{where}: reST markup {m.group(0).strip()!r} (line {line})"
                )
    assert not problems, "docstrings not in Google style:\n  " + "\n  ".join(problems)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site built once with ``mkdocs build --strict`` (what ``nox -s docs`` runs); needs
    the ``docs`` extra."""
    for mod in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(mod, reason="the docs extra is not installed: pip install -e .[docs]")
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return site, proc


def test_mkdocs_build_strict(built_site):
    site, proc = built_site
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (site / "api" / "index.html").is_file()


RAW_ROLE = re.compile(r":(meth|class|func|attr|mod|exc):`?")


def _cell(name: str) -> str:
    """A table cell holding ``name`` as code (mkdocstrings' section tables)."""
    return rf"<td[^>]*>\s*<code>(?:<span[^>]*>)?{name}(?:</span>)?</code>"


def test_api_page_renders_docstrings(built_site):
    """The API page has no reST role left as text, and Google sections render as tables."""
    site, proc = built_site
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    roles = sorted({m.group(0) for m in RAW_ROLE.finditer(html)})
    assert not roles, f"raw reST roles on the API page: {roles}"
    # a docstring section that did not parse shows up as its literal heading
    for heading in ("Args:", "Returns:", "Raises:", "Attributes:"):
        assert f"<p>{heading}" not in html, f"an unparsed {heading!r} section"
    # OptimizerConfig's options: one table row each, none swallowed into a collapsible box
    config = html[html.index('id="mfsdp_optim.optim.OptimizerConfig"') :]
    for option in ("clip_grad", "norm_type", "filter_empty_shards", "host_sync"):
        assert re.search(_cell(option), config), option
    assert not re.search(r"<details[^>]*>(?:(?!</details>).)*filter_empty_shards", config, re.S)
    # FullyShardedOptimizer's Args: a parameters table holding every constructor argument
    wrapper = _object(html, "mfsdp_optim.optim.FullyShardedOptimizer")
    table = _section_table(wrapper, "Parameters")
    for arg in ("optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks"):
        assert re.search(_cell(arg), table), arg
    # NamedTuple fields as Attributes rows, step()'s tuple as named Returns rows
    for obj, names in (
        ("mfsdp_optim.stats.GradStats", ("total_norm", "num_zeros", "found_inf")),
        (
            "mfsdp_optim.stats.DuplicatedParam",
            ("fqn", "copies", "meshes", "placements", "evidence"),
        ),
    ):
        table = _section_table(_object(html, obj), "Attributes")
        for name in names:
            assert re.search(_cell(name), table), (obj, name)
    step = _section_table(_object(html, "mfsdp_optim.optim.FullyShardedOptimizer.step"), "Returns")
    for name in ("update_successful", "grad_norm", "num_zeros_in_grad"):
        assert re.search(_cell(name), step), name
    # a reST literal block ("Save::") shows up as text ending in "::"
    literal = re.findall(r"[^\s<>]{1,40}::</p>", html)
    assert not literal, f"reST literal blocks on the API page: {literal}"
    # a cross-reference whose target is not on the page stays as its literal [title][id] text
    unresolved = sorted(set(re.findall(r"\[[^\[\]<>]{1,80}\]\[mfsdp_optim[\w.]*\]", html)))
    assert not unresolved, f"unresolved cross-references on the API page: {unresolved}"


def _object(html: str, identifier: str) -> str:
    """The HTML of one documented object, from its heading to the next object's heading."""
    start = html.index(f'id="{identifier}"')
    end = html.find('<div class="doc doc-object', start)
    return html[start : end if end != -1 else len(html)]


def _section_table(html: str, title: str) -> str:
    """The first ``title:`` section table in ``html`` (empty when there is none)."""
    m = re.search(
        rf'<span class="doc-section-title">{title}:</span>.*?<table>(.*?)</table>', html, re.S
    )
    return m.group(1) if m else ""
