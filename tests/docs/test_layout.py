"""Every page of the BUILT site fits its content column at 1280 px, in a real headless browser.

The rule (docs/internals.md, "Rules the docs keep"): at a 1280 x 900 window, no element of a
page's article is wider than the article's column (its margin box: the theme's table wrapper
reaches into the margins on purpose), and no element hides content behind a sideways scrollbar
(``scrollWidth > clientWidth`` on a box that scrolls or clips). A wide table or code block is
split, shortened or re-worded; no page keeps one that scrolls.

How: the site is built with ``mkdocs build --strict``; a small script (``PROBE``) is added to
every page of that copy; Debian's ``chromium --headless --dump-dom`` loads each page, the
script measures it after the load event and writes what it found into the DOM, and the test
reads it back. Without a browser the test is skipped with the reason, except under ``CI=true``
(``.ci/run`` installs ``chromium``), where it fails.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _site import build_site

ROOT = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1280, 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Runs in the page after its load event; appends <pre id="layout-report">[...]</pre>.
PROBE = r"""
(function () {
  function heading(el, col) {
    for (var e = el; e && e !== col; e = e.parentElement) {
      for (var p = e.previousElementSibling; p; p = p.previousElementSibling) {
        if (/^H[1-6]$/.test(p.tagName)) return p.textContent.replace("\u00b6", "").trim();
      }
    }
    return "";
  }
  function report() {
    var col = document.querySelector("article.md-content__inner");
    var out = [];
    if (!col) {
      out.push({tag: "article", width: 0, column: 0, under: "", text: "no article found"});
    } else {
      var cs = getComputedStyle(col), r0 = col.getBoundingClientRect();
      var left = r0.left - parseFloat(cs.marginLeft);
      var right = r0.right + parseFloat(cs.marginRight);
      var flagged = [];
      var all = col.querySelectorAll("*");
      for (var i = 0; i < all.length; i++) {
        var el = all[i];
        if (flagged.some(function (f) { return f.contains(el); })) continue;
        var r = el.getBoundingClientRect();
        if (r.width === 0 || r.height === 0) continue;
        var wide = r.right > right + 1 || r.left < left - 1;
        var ox = getComputedStyle(el).overflowX;
        var hides = el.clientWidth > 0 && el.scrollWidth > el.clientWidth + 1 &&
          ["auto", "scroll", "hidden", "clip"].indexOf(ox) >= 0;
        if (wide || hides) {
          flagged.push(el);
          out.push({tag: el.tagName.toLowerCase(),
                    width: Math.round(hides ? el.scrollWidth : r.width),
                    column: Math.round(right - left), under: heading(el, col),
                    text: el.textContent.replace(/\s+/g, " ").trim().slice(0, 70)});
        }
      }
    }
    var pre = document.createElement("pre");
    pre.id = "layout-report";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  }
  if (document.readyState === "complete") report();
  else window.addEventListener("load", report);
})();
"""
REPORT = re.compile(r'<pre id="layout-report">(.*?)</pre>', re.S)


def find_browser() -> str | None:
    named = os.environ.get("MFSDP_DOCS_BROWSER")
    if named:
        return shutil.which(named) or named
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


@pytest.fixture(scope="module")
def browser() -> str:
    found = find_browser()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no headless browser: .ci/run installs Debian's chromium")
        pytest.skip(
            "no headless browser on this machine (apt-get install chromium, or set "
            "MFSDP_DOCS_BROWSER); CI=true makes this a failure"
        )
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built with ``mkdocs build --strict``, the probe added to every page."""
    out = build_site(tmp_path_factory.mktemp("site"))
    (out / "layout-probe.js").write_text(PROBE, encoding="utf-8")
    for page in pages(out):
        add_probe(out, page)
    return out


def pages(site: Path) -> list[Path]:
    return sorted(
        p
        for p in site.rglob("index.html")
        if p.relative_to(site).parts[0] not in ("assets", "search", "404")
    )


def add_probe(site: Path, page: Path) -> None:
    up = "../" * (len(page.relative_to(site).parts) - 1)
    text = page.read_text(encoding="utf-8")
    assert "</body>" in text, page
    tag = f'<script src="{up}layout-probe.js"></script></body>'
    page.write_text(text.replace("</body>", tag, 1), encoding="utf-8")


def measure(browser: str, page: Path) -> list[dict]:
    """What the probe found on one page, loaded at WIDTH x HEIGHT."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--no-first-run",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                "--virtual-time-budget=5000",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    m = REPORT.search(proc.stdout)
    assert m, f"{page}: no layout report (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


def measure_all(browser: str, site: Path, targets: list[Path]) -> dict[str, list[dict]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = pool.map(lambda p: measure(browser, p), targets)
        return {str(p.parent.relative_to(site)): f for p, f in zip(targets, found, strict=True)}


def describe(name: str, problem: dict) -> str:
    return (
        f"{name}: <{problem['tag']}> {problem['width']} px in a {problem['column']} px column, "
        f"under {problem['under']!r}: {problem['text']!r}"
    )


def test_probe_flags_a_wide_table_and_a_wide_code_block(browser, site):
    """The probe on a real page of the theme, given one wide table and one wide code line (it
    must flag both), and the same page unchanged (it must flag neither)."""
    page = site / "quickstart" / "index.html"
    text = page.read_text(encoding="utf-8")
    cells = "".join(f"<td>column_{i}_with_a_long_unbreakable_name</td>" for i in range(12))
    wide = (
        f"<table><thead><tr>{cells}</tr></thead><tbody><tr>{cells}</tr></tbody></table>"
        f"<pre><code>{'x' * 300}</code></pre>"
    )
    assert '<article class="md-content__inner md-typeset">' in text
    broken = site / "probe-check" / "index.html"
    broken.parent.mkdir()
    broken.write_text(text.replace("</article>", wide + "</article>", 1), encoding="utf-8")
    found = measure_all(browser, site, [page, broken])
    assert found["quickstart"] == [], found["quickstart"]
    texts = sorted(p["text"][:8] for p in found["probe-check"])
    assert texts == ["column_0", "xxxxxxxx"], found["probe-check"]


def test_every_page_fits_at_1280_px(browser, site):
    targets = [p for p in pages(site) if p.parent.name != "probe-check"]
    assert len(targets) >= 15, targets
    found = measure_all(browser, site, targets)
    problems = [describe(name, p) for name, ps in sorted(found.items()) for p in ps]
    assert not problems, f"{len(problems)} elements wider than their column:\n" + "\n".join(
        problems
    )
