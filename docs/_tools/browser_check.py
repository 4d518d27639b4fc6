"""Open every page of the built site in headless Chromium and check it as a reader would.

Usage (``nox -s browser`` runs both)::

    python docs/_tools/browser_check.py --self-test   # the checks catch each defect
    python docs/_tools/browser_check.py               # check docs/_build/html

The site is served on localhost; any request elsewhere is blocked and reported, so a page
that needs the network fails. A page fails on: a console error or uncaught exception, a
request that fails or returns an HTTP error, an image that did not load, a content image
without alt text, a table with no rows or only empty cells, a table whose content is hidden
by overflow (it scrolls, is clipped, or runs past a 1280-pixel window), a link to a page of
the site that does not exist, a code block without its copy button, a cell output written
to stderr (a log line the reader should not see), and, for a case page (``cases/*``), no
chart. The search page must find the site's pages for a query (Sphinx's search runs in the
browser, offline). A full-page screenshot of
every page is saved under ``docs/_build/browser/`` with ``report.json``.

Chromium is Debian's (``apt-get install chromium``), driven by Playwright; Playwright
downloads nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import pathlib
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator

DOCS = pathlib.Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SKIP_DIRS = {"_static", "_sources", "_images", "_modules", ".doctrees"}

# What the page reports about itself, evaluated in the browser after everything loaded.
_INSPECT = """
async () => {
  window.scrollTo(0, document.body.scrollHeight);
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null :
    new Promise(r => { i.addEventListener("load", r); i.addEventListener("error", r);
                       setTimeout(r, 5000); })));
  window.scrollTo(0, 0);
  const main = document.querySelector("main, article, [role=main]") || document.body;
  const text = e => (e.textContent || "").trim();
  return {
    title: document.title,
    images: imgs.map(i => ({
      src: i.getAttribute("src") || "", alt: (i.getAttribute("alt") || "").trim(),
      loaded: i.complete && i.naturalWidth > 0, content: main.contains(i),
      output: !!i.closest(".cell_output, .output, figure"),
    })),
    tables: Array.from(main.querySelectorAll("table")).map(t => {
      const rows = Array.from(t.querySelectorAll("tr")).filter(r => !r.closest("thead"));
      const cells = rows.flatMap(r => Array.from(r.querySelectorAll("td, th")));
      return { id: t.id || t.className || "table", rows: rows.length,
               filled: cells.filter(c => text(c) !== "").length };
    }),
    // A table whose content does not fit: it, or a box around it that scrolls or clips,
    // is wider inside than it shows, or it runs past the window's right edge.
    clipped: Array.from(main.querySelectorAll("table")).filter(t => {
      for (let e = t; e && e !== main.parentElement; e = e.parentElement) {
        const o = getComputedStyle(e).overflowX;
        if (o !== "visible" && e.scrollWidth > e.clientWidth + 1) return true;
      }
      return t.getBoundingClientRect().right > document.documentElement.clientWidth + 1;
    }).map(t => t.id || t.className || "table"),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.getAttribute("href")),
    stderr: Array.from(main.querySelectorAll(".output.stderr"))
      .map(e => text(e).split("\\n")[0].slice(0, 120)),
    uncopyable: Array.from(main.querySelectorAll("div.highlight"))
      .filter(d => !d.querySelector("button.copybtn")).length,
  };
}
"""


def pages(root: pathlib.Path) -> list[str]:
    """Every HTML page of the build, as a path relative to `root`."""
    found = []
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root)
        if not SKIP_DIRS & set(rel.parts):
            found.append(rel.as_posix())
    return found


@contextlib.contextmanager
def serve(root: pathlib.Path) -> Iterator[str]:
    """Serve `root` on an unused localhost port; yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _screenshot_name(page: str) -> str:
    return page.removesuffix(".html").replace("/", "__") + ".png"


def _dead_link(root: pathlib.Path, page: str, href: str) -> bool:
    """True when `href` is a relative link to a file of the site that does not exist."""
    parsed = urllib.parse.urlsplit(href)
    if parsed.scheme or parsed.netloc or not parsed.path or href.startswith("#"):
        return False
    target = (root / page).parent / urllib.parse.unquote(parsed.path)
    if parsed.path.endswith("/"):
        target = target / "index.html"
    return not target.resolve().exists()


def check_page(context, base: str, root: pathlib.Path, page: str, shots: pathlib.Path) -> dict:
    """Load one page; return what went wrong (an empty `problems` list if nothing)."""
    problems: list[str] = []
    tab = context.new_page()
    tab.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    tab.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))
    tab.on(
        "requestfailed",
        lambda r: problems.append(f"request failed: {r.url} ({r.failure})"),
    )
    tab.on(
        "response",
        lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"),
    )

    def route(r) -> None:
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:  # the site must work with no network: nothing outside localhost
            problems.append(f"external request: {r.request.url}")
            r.abort()

    tab.route("**/*", route)
    tab.goto(base + page, wait_until="load")
    with contextlib.suppress(Exception):  # pages that keep a connection open still count
        tab.wait_for_load_state("networkidle", timeout=10_000)
    info = tab.evaluate(_INSPECT)
    for img in info["images"]:
        if not img["loaded"]:
            problems.append(f"broken image: {img['src']}")
        elif img["content"] and (
            not img["alt"] or img["alt"] == img["src"] or img["alt"].endswith((".png", ".svg"))
        ):
            problems.append(f"image without alt text: {img['src']}")
    for table in info["tables"]:
        if table["rows"] == 0 or table["filled"] == 0:
            problems.append(f"empty table: {table['id']}")
    for table in info["clipped"]:
        problems.append(f"content hidden by overflow: a {table} wider than the page shows")
    if page.startswith("cases/") and not any(i["output"] and i["loaded"] for i in info["images"]):
        problems.append("case page without its chart (no image in a cell output or figure)")
    for line in info["stderr"]:
        problems.append(f"stderr in a cell output: {line}")
    if info["uncopyable"]:
        problems.append(f"code block without copy button: {info['uncopyable']} of them")
    for href in sorted(set(info["links"])):
        if _dead_link(root, page, href):
            problems.append(f"dead link: {href}")
    if page == "search.html":
        _check_search(tab, base, problems)
    shot = shots / _screenshot_name(page)
    tab.screenshot(path=str(shot), full_page=True)
    tab.close()
    return {
        "page": page,
        "title": info["title"],
        "images": len(info["images"]),
        "tables": len(info["tables"]),
        "screenshot": str(shot),
        "problems": problems,
    }


SEARCH_QUERY = "memory"


def _check_search(tab, base: str, problems: list[str]) -> None:
    """Search the site for SEARCH_QUERY; the results must list at least one page."""
    from playwright.sync_api import TimeoutError as NoResult

    tab.goto(f"{base}search.html?q={SEARCH_QUERY}", wait_until="load")
    try:
        tab.wait_for_selector("#search-results ul.search li a", timeout=15_000)
    except NoResult:
        problems.append(f"search finds no page for {SEARCH_QUERY!r}")


def check_site(root: pathlib.Path, shots: pathlib.Path, chromium: str) -> list[dict]:
    """Check every page under `root`; screenshots go to `shots`."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    results = []
    with (
        serve(root) as base,
        sync_playwright() as pw,
        tempfile.TemporaryDirectory(prefix="browser-check-profile-") as profile,
    ):
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            for page in pages(root):
                results.append(check_page(context, base, root, page, shots))
        finally:
            context.close()
    return results


# --- the self-test: a small site with one defect per page -------------------------------


def _png() -> bytes:
    """A valid 2x2 red PNG, made here rather than pasted."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\0" + b"\xff\0\0" * 2 for _ in range(2))
    header = struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


_TABLE = "<table><thead><tr><th>a</th></tr></thead><tbody><tr><td>1</td></tr></tbody></table>"
_CHART = '<div class="cell_output"><img src="{up}chart.png" alt="A chart of bytes."></div>'
SELF_TEST = {
    # page: (html body, the problem the check must report, or None for a clean page)
    "good.html": (_TABLE + _CHART.format(up="") + '<a href="cases/good.html">ok</a>', None),
    "cases/good.html": (_CHART.format(up="../"), None),
    "console.html": ("<script>console.error('boom')</script>", "console error"),
    "exception.html": ("<script>notDefined()</script>", "uncaught exception"),
    "broken-image.html": ('<img src="missing.png" alt="a chart">', "broken image"),
    "no-alt.html": ('<img src="chart.png">', "image without alt text"),
    "empty-table.html": ("<table><thead><tr><th>a</th></tr></thead><tbody></tbody></table>",
                         "empty table"),
    "blank-table.html": ("<table><tr><td> </td></tr></table>", "empty table"),
    "cases/no-chart.html": (_TABLE, "case page without its chart"),
    "external.html": ('<img src="https://example.com/x.png" alt="x">', "external request"),
    "dead-link.html": ('<a href="missing-page.html">x</a>', "dead link"),
    "search.html": ('<div id="search-results"></div>', "search finds no page"),
    "stderr.html": ('<div class="output stderr"><pre>E1123 gpu_hlo_schedule.cc] log</pre></div>',
                    "stderr in a cell output"),
    "no-copy.html": ('<div class="highlight"><pre>x = 1</pre></div>', "code block without copy"),
    "clipped.html": ('<div style="width:300px;overflow-x:auto"><table><tr><td>'
                     + "x" * 200 + "</td></tr></table></div>", "content hidden by overflow"),
    "too-wide.html": ('<table style="width:3000px"><tr><td>wide</td></tr></table>',
                      "content hidden by overflow"),
}  # fmt: skip


def self_test(shots: pathlib.Path, chromium: str) -> list[str]:
    """Check a site built to fail in known ways; return what the check missed."""
    missed = []
    with tempfile.TemporaryDirectory(prefix="browser-check-site-") as tmp:
        root = pathlib.Path(tmp)
        (root / "cases").mkdir()
        (root / "chart.png").write_bytes(_png())
        for page, (body, _) in SELF_TEST.items():
            (root / page).write_text(f"<!doctype html><title>{page}</title><main>{body}</main>")
        results = {r["page"]: r for r in check_site(root, shots, chromium)}
    for page, (_, expected) in SELF_TEST.items():
        problems = results[page]["problems"]
        if expected is None and problems:
            missed.append(f"{page}: a clean page was flagged: {problems}")
        elif expected is not None and not any(p.startswith(expected) for p in problems):
            missed.append(f"{page}: expected '{expected}', got {problems}")
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--html", type=pathlib.Path, default=DOCS / "_build" / "html")
    parser.add_argument("--out", type=pathlib.Path, default=DOCS / "_build" / "browser")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--self-test", action="store_true", help="check the checks, then exit")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.chromium).exists():
        print(
            f"browser check: no Chromium at {args.chromium}. Install Debian's package "
            "(`apt-get install chromium`) or pass --chromium PATH.",
            file=sys.stderr,
        )
        return 2
    if args.self_test:
        missed = self_test(args.out / "self-test", args.chromium)
        for line in missed:
            print(f"self-test: {line}", file=sys.stderr)
        print(f"self-test: {len(SELF_TEST) - len(missed)}/{len(SELF_TEST)} pages judged right")
        return 1 if missed else 0
    if not (args.html / "index.html").exists():
        print(f"browser check: no site at {args.html}; run `nox -s docs` first.", file=sys.stderr)
        return 2
    results = check_site(args.html, args.out, args.chromium)
    (args.out / "report.json").write_text(json.dumps(results, indent=1))
    failed = [r for r in results if r["problems"]]
    for r in results:
        status = "FAIL" if r["problems"] else "ok  "
        print(f"{status} {r['page']} ({r['images']} images, {r['tables']} tables)")
        for problem in r["problems"]:
            print(f"       {problem}")
    print(f"{len(results) - len(failed)}/{len(results)} pages pass; screenshots in {args.out}")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
