"""The built documentation site (docs/_build/html, after `make docs`): what a reader sees.

* Nothing of a table or a code block is cut off at the text column's edge: headless Chromium
  (.ci/run installs Debian's `chromium` before the tests) lays out every guide page and the
  algorithms page at once, each in a 1400 x 1000 frame, and a script measures
  in each the text column and every table and code block in it (skipped without Chromium).
* The notebooks' pages show their outputs (the build runs them with small settings).

Skipped where the site is not built.
"""

import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome"))), None)
WIDTH, HEIGHT = 1400, 1000

# For each frame: the article's content box, and every table (its scrolling container) and
# code block wider than it or wider than its own box (scrolled or clipped).
MEASURE = """
<script>
const frames = Array.from(document.querySelectorAll("iframe"));
Promise.all(frames.map(f => new Promise(ok => { f.onload = ok; f.src = f.dataset.src; })))
  .then(() => {
    const out = frames.map(f => {
      const doc = f.contentDocument, article = doc.querySelector(".bd-article");
      const box = article.getBoundingClientRect();
      const right = box.right - parseFloat(getComputedStyle(article).paddingRight);
      const blocks = Array.from(article.querySelectorAll(
        "table, div.pst-scrollable-table-container, div.highlight pre"));
      const cut = blocks.filter(e => e.getBoundingClientRect().right > right + 1 ||
                                     e.scrollWidth > e.clientWidth + 1)
        .map(e => `${e.tagName}: ${e.textContent.trim().slice(0, 60)} ` +
                  `(${Math.round(e.scrollWidth)} px wide, ${Math.round(e.clientWidth)} shown)`);
      return {page: f.dataset.src, column: box.width, blocks: blocks.length, cut: cut};
    });
    document.body.setAttribute("data-measure", JSON.stringify(out));
  });
</script>
"""


def _pages():
  """The guide and the algorithms. (The results' tables of measurements, up to 13 columns of
  numbers, one per link, scroll in their boxes.)"""
  return sorted(SITE.glob("guide/*.html")) + [SITE / "algorithms.html"]


BUILT = pytest.mark.skipif(not (SITE / "index.html").exists(), reason="docs not built")


@BUILT
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)")
@pytest.mark.slow  # one Chromium run, a few seconds
def test_no_table_or_code_block_is_cut_off_in_a_1400_px_window(tmp_path):
  pages = _pages()
  frames = "".join(f'<iframe data-src="{p.as_uri()}" width="{WIDTH}" height="{HEIGHT}">'
                   "</iframe>" for p in pages)
  harness = tmp_path / "harness.html"
  harness.write_text(f"<html><body>{frames}{MEASURE}</body></html>")
  proc = subprocess.run(
      [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
       "--allow-file-access-from-files", f"--window-size={WIDTH + 100},{HEIGHT + 100}",
       "--virtual-time-budget=20000", "--dump-dom", harness.as_uri()],
      capture_output=True, text=True, timeout=120, check=False)
  found = re.search(r'data-measure="([^"]*)"', proc.stdout)
  assert found, proc.stderr[-3000:]
  measured = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
  assert len(measured) == len(pages)
  assert sum(m["blocks"] for m in measured) >= 30  # the guide's tables and code blocks
  for m in measured:
    assert m["column"] > 700, m  # the text column beside both sidebars
    assert not m["cut"], m


@BUILT
def test_every_notebook_page_shows_its_outputs():
  notebooks = sorted((ROOT / "colab").glob("*.ipynb"))
  assert notebooks
  for nb in notebooks:
    page = (SITE / "notebooks" / f"{nb.stem}.html").read_text(encoding="utf-8")
    code, shown = page.count('class="cell_input'), page.count('class="cell_output')
    assert code and shown >= 2, (nb.name, code, shown)  # the setup cell prints the devices
    assert "8 devices: cpu" in page, nb.name
