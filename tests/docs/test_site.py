"""The BUILT site (HTML), checked for what a reader trips over.

Map: ``site`` builds it once per module (``mkdocs build --strict``); ``Page`` parses one page's
article; one test per defect: raw table pipes, HTML tags swallowed from text, headings that
jump or nest under the wrong parent, exported names without an API entry, code lines wider
than the page (80 columns); each checker is first shown a broken snippet it must flag.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from _site import build_site

ROOT = Path(__file__).resolve().parents[2]
MAX_CODE_COLUMNS = 80
PUBLIC_MODULES = (
    "mfsdp_optim",
    "mfsdp_optim.stats",
    "mfsdp_optim.optim",
    "mfsdp_optim.checkpoint",
    "mfsdp_optim.errors",
)

# every element a page may hold: a name outside this set is text such as "<root>" that the
# browser took for a tag and dropped
KNOWN_TAGS = set(
    [
        "html",
        "head",
        "body",
        "meta",
        "link",
        "title",
        "script",
        "style",
        "noscript",
        "base",
        "div",
        "span",
        "a",
        "p",
        "ul",
        "ol",
        "li",
        "dl",
        "dt",
        "dd",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "header",
        "footer",
        "nav",
        "main",
        "article",
        "section",
        "aside",
        "label",
        "input",
        "button",
        "form",
        "img",
        "table",
        "thead",
        "tbody",
        "tfoot",
        "tr",
        "th",
        "td",
        "caption",
        "colgroup",
        "col",
        "code",
        "pre",
        "em",
        "strong",
        "b",
        "i",
        "u",
        "s",
        "sub",
        "sup",
        "small",
        "br",
        "hr",
        "blockquote",
        "details",
        "summary",
        "figure",
        "figcaption",
        "kbd",
        "abbr",
        "mark",
        "del",
        "ins",
        "iframe",
        "template",
        "time",
        "textarea",
        "select",
        "option",
        "picture",
        "source",
        "video",
        "audio",
        "canvas",
        "wbr",
        "q",
        "cite",
        "dfn",
        "var",
        "samp",
        "object",
        "svg",
        "path",
        "g",
        "circle",
        "rect",
        "line",
        "polyline",
        "polygon",
        "text",
        "tspan",
        "defs",
        "use",
        "symbol",
        "clippath",
        "lineargradient",
        "radialgradient",
        "stop",
        "ellipse",
        "title",
        "desc",
        "mask",
        "pattern",
        "marker",
    ]
)
VOID = {"meta", "link", "img", "br", "hr", "input", "col", "source", "wbr", "base"}


@dataclass
class Heading:
    level: int
    ident: str
    is_object: bool  # a mkdocstrings object heading (class "doc-heading")
    text: str = ""


@dataclass
class Page:
    """What the checks need from one page's article (the main content, not nav or TOC)."""

    name: str
    headings: list[Heading] = field(default_factory=list)
    paragraphs: list[str] = field(default_factory=list)  # text of each <p>, code included
    code_blocks: list[str] = field(default_factory=list)  # text of each <pre>
    unknown_tags: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)


class _Parser(HTMLParser):
    def __init__(self, page: Page):
        super().__init__(convert_charrefs=True)
        self.page = page
        self.depth = 0  # >0 inside the article
        self.in_p = self.in_pre = 0
        self.heading: Heading | None = None
        self.buf: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag not in KNOWN_TAGS:
            self.page.unknown_tags.append(tag)
        if a.get("id"):
            self.page.ids.add(a["id"] or "")
        if tag == "article":
            self.depth += 1
        if not self.depth or tag in VOID:
            return
        if tag == "p":
            self.in_p += 1
            self.buf = []
        elif tag == "pre":
            self.in_pre += 1
            self.buf = []
        elif re.fullmatch(r"h[1-6]", tag):
            classes = (a.get("class") or "").split()
            self.heading = Heading(int(tag[1]), a.get("id") or "", "doc-heading" in classes)
            self.buf = []

    def handle_endtag(self, tag):
        if tag == "article":
            self.depth -= 1
        if not self.depth:
            return
        if tag == "p" and self.in_p:
            self.in_p -= 1
            self.page.paragraphs.append("".join(self.buf))
        elif tag == "pre" and self.in_pre:
            self.in_pre -= 1
            self.page.code_blocks.append("".join(self.buf))
        elif re.fullmatch(r"h[1-6]", tag) and self.heading is not None:
            self.heading.text = "".join(self.buf).strip().rstrip("¶").strip()
            self.page.headings.append(self.heading)
            self.heading = None

    def handle_data(self, data):
        if self.depth and (self.in_p or self.in_pre or self.heading is not None):
            self.buf.append(data)


def parse(name: str, html: str) -> Page:
    page = Page(name)
    _Parser(page).feed(html)
    return page


# ---- the checks: each returns a list of problems (empty = fine) -------------------------------

RAW_ROW = re.compile(r"^\s*\|.*\|\s*$", re.M)


def raw_table_pipes(page: Page) -> list[str]:
    """A markdown table row that did not become a table (a blank line ended the table)."""
    return [
        f"{page.name}: raw table text {m.group(0).strip()[:80]!r}"
        for p in page.paragraphs
        for m in [RAW_ROW.search(p)]
        if m
    ]


def swallowed_tags(page: Page) -> list[str]:
    """Text like ``<root>`` written outside code: the browser drops it as an unknown tag."""
    return [
        f"{page.name}: <{t}> is not HTML (text swallowed)" for t in sorted(set(page.unknown_tags))
    ]


def heading_problems(page: Page) -> list[str]:
    """One H1; no level skipped going down; an API object nests under its section title."""
    out = []
    h1 = [h.text for h in page.headings if h.level == 1]
    if len(h1) != 1:
        out.append(f"{page.name}: {len(h1)} H1 headings {h1} (the TOC shows only one)")
    previous = 0
    for i, h in enumerate(page.headings):
        if h.level > previous + 1 and previous:
            out.append(f"{page.name}: h{previous} -> h{h.level} at {h.text!r}")
        previous = h.level
        if h.is_object:
            section = next((s for s in reversed(page.headings[:i]) if not s.is_object), None)
            if section is not None and section.level >= h.level:
                out.append(
                    f"{page.name}: object {h.text!r} (h{h.level}) is not nested under the "
                    f"section {section.text!r} (h{section.level})"
                )
    return out


def long_code_lines(page: Page, limit: int = MAX_CODE_COLUMNS) -> list[str]:
    """Code (examples, output, signatures) wider than the content column."""
    return [
        f"{page.name}: {len(line)} columns: {line[:60]!r}..."
        for block in page.code_blocks
        for line in block.splitlines()
        if len(line.rstrip()) > limit
    ]


def exported_names() -> list[str]:
    """Every name of the public ``__all__`` lists, as ``module.name``."""
    names = []
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        names += [f"{mod_name}.{n}" for n in mod.__all__]
    return names


def missing_api_entries(api: Page, names: list[str]) -> list[str]:
    """An exported name whose object has no entry (heading id) on the API page, under any of the
    public paths it is exported from."""
    out = []
    for qual in names:
        short = qual.rsplit(".", 1)[1]
        if not any(f"{m}.{short}" in api.ids for m in PUBLIC_MODULES):
            out.append(f"{qual} has no entry on the API page")
    return out


# ---- the checkers flag broken snippets (so a broken checker cannot pass silently) ------------

ARTICLE = (
    '<html><body><nav><h1>nav</h1></nav><article class="md-typeset">{}</article></body></html>'
)


def test_checkers_flag_each_defect():
    bad_table = parse(
        "t", ARTICLE.format("<h1>T</h1><p>| D13 | <code>x</code> | y |\n| D14 | z |</p>")
    )
    assert raw_table_pipes(bad_table)
    assert not raw_table_pipes(parse("t", ARTICLE.format("<p>a | b</p><table></table>")))

    tag = parse("t", ARTICLE.format("<h1>T</h1><p>refusing to load <root>/missing</p>"))
    assert swallowed_tags(tag) == ["t: <root> is not HTML (text swallowed)"]
    ok = parse("t", ARTICLE.format("<h1>T</h1><p>refusing to load &lt;root&gt;/missing</p>"))
    assert not swallowed_tags(ok)

    assert heading_problems(parse("t", ARTICLE.format("<h1>A</h1><h3>B</h3>")))
    assert heading_problems(parse("t", ARTICLE.format("<h1>A</h1><h1>B</h1>")))
    nested_wrong = ARTICLE.format(
        '<h1>A</h1><h2>S</h2><h2 class="doc doc-heading">f</h2><h3>Layout</h3>'
        '<h2 class="doc doc-heading">g</h2>'
    )
    assert [p for p in heading_problems(parse("t", nested_wrong)) if "'g'" in p]
    nested_right = ARTICLE.format(
        '<h1>A</h1><h2>S</h2><h3 class="doc doc-heading">f</h3>'
        '<h4 class="doc doc-heading">f.m</h4><h2>Layout</h2><h3 class="doc doc-heading">g</h3>'
    )
    assert not heading_problems(parse("t", nested_right))

    code = parse("t", ARTICLE.format("<h1>A</h1><pre><code>" + "x" * 81 + "\nok</code></pre>"))
    assert len(long_code_lines(code)) == 1
    assert not long_code_lines(parse("t", ARTICLE.format("<pre>" + "x" * 80 + "</pre>")))

    api = parse("api", ARTICLE.format('<h2 id="mfsdp_optim.stats.get_grad_norm">g</h2>'))
    assert missing_api_entries(api, ["mfsdp_optim.get_grad_norm", "mfsdp_optim.stats.x"]) == [
        "mfsdp_optim.stats.x has no entry on the API page"
    ]


# ---- the built site ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[str, Page]:
    """Every page of the site built once with ``mkdocs build --strict``, by page name."""
    out = build_site(tmp_path_factory.mktemp("site"))
    pages = {}
    for html in sorted(out.rglob("index.html")):
        name = str(html.parent.relative_to(out)) if html.parent != out else "index"
        if name == "404" or name.startswith("assets"):
            continue
        pages[name] = parse(name, html.read_text(encoding="utf-8"))
    assert {"index", "api", "errors", "benchmarks"} <= set(pages), sorted(pages)
    return pages


def _all(site: dict[str, Page], check) -> list[str]:
    return [problem for page in site.values() for problem in check(page)]


def test_no_raw_table_pipes(site):
    problems = _all(site, raw_table_pipes)
    assert not problems, "\n".join(problems)


def test_no_swallowed_tags(site):
    problems = _all(site, swallowed_tags)
    assert not problems, "\n".join(problems)


def test_headings_nest(site):
    problems = _all(site, heading_problems)
    assert not problems, "\n".join(problems)


def test_code_fits_the_page(site):
    problems = _all(site, long_code_lines)
    assert not problems, f"{len(problems)} code lines over {MAX_CODE_COLUMNS} columns:\n" + (
        "\n".join(problems[:40])
    )


def test_every_exported_name_has_an_api_entry(site):
    names = exported_names()
    assert len(names) >= 35, names
    problems = missing_api_entries(site["api"], names)
    assert not problems, "\n".join(problems)
