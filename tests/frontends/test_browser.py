"""The dashboard notebook in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

The block grid must render and keep changing both while a cell is busy and after it has returned (the
refresher thread pushes updates in either state); under the default pool its in-use cells are drawn at a
readable size, and no number is stale (idle rate, summary(), the frame after close()). Skips only when
Chromium, JupyterLab or Playwright is missing; .ci/install-system-packages.sh and the `dev` extra install them in CI.

HF_CONTBATCH_UPDATE_DOCS=1 writes the dashboard screenshot of a run to docs/dashboard.png (the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from jupyter_fixtures import (  # noqa: F401 - fixtures used by name
    NOTEBOOKS,
    ROOT,
    browser,
    browser_missing_reason,
    copy_notebook,
    lab_server,
    require_default_model,
)

_MISSING = browser_missing_reason()
pytestmark = [pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""), pytest.mark.slow]

# The widget's element stays in the DOM; its contents are replaced on every update, so screenshots and
# HTML comparisons take the widget element.
GRID = ".hfcb-block-grid"
IN_USE_CELL = GRID + " .hfcb-device .hfcb-grid i[title*='request']"
# A device-pool cell owned by a request, in the grid's HTML (the legend also says "request").
IN_USE_TITLE = re.compile(r'title="block \d+ · request \d+"')
# Rounds of the notebook's 32 background requests in the test's copy: enough work that the engine
# is still busy well after the busy cell returns, however fast the machine (one round lasted about
# 4 s after it here; the CI machine once finished it before the kernel read idle).
ROUNDS = 4

# nbformat (and nbclient) are imported in the functions that use them: with jsonschema they take about
# 3-4 s to import, which every pytest-xdist worker would pay when it collects this module.


def _save_docs_picture(png: bytes, name: str, colours: int = 128) -> None:
    """With HF_CONTBATCH_UPDATE_DOCS=1: ``png`` as docs/<name>, reduced to a small palette PNG."""
    if os.environ.get("HF_CONTBATCH_UPDATE_DOCS") != "1":
        return
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colours, method=Image.Quantize.MEDIANCUT)
    (ROOT / "docs").mkdir(exist_ok=True)
    image.save(ROOT / "docs" / name, optimize=True)


def _cell_index(tag: str) -> int:
    import nbformat

    nb = nbformat.read(NOTEBOOKS / "02_dashboard.ipynb", as_version=4)
    return next(i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", []))


def _copy_with_rounds(root, rounds: int) -> None:
    """The dashboard notebook with ``rounds`` of background requests, and its busy cell's requests
    made 2.5x longer (still within the 48-block pool), so that the cell is still running after
    two screenshots on a fast CPU."""
    import nbformat

    path = copy_notebook("02_dashboard.ipynb", root)
    nb = nbformat.read(path, as_version=4)
    cell = nb.cells[_cell_index("background")]
    assert "rounds = 1 " in cell.source, "the background cell no longer sets `rounds`"
    cell.source = cell.source.replace("rounds = 1 ", f"rounds = {rounds} ")
    busy = nb.cells[_cell_index("busy")]
    lengths = "max_new_tokens=[256, 256, 192, 192, 128, 128]"
    assert lengths in busy.source, "the busy cell's max_new_tokens changed"
    busy.source = busy.source.replace(lengths, "max_new_tokens=[640, 640, 480, 480, 320, 320]")
    nbformat.write(nb, path)


def _run_cells(page, count: int) -> None:
    for _ in range(count):
        page.keyboard.press("Shift+Enter")


def _prompt(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text()


def _output(page, index: int, text: str):
    """The output of cell ``index`` containing ``text`` (not its source, which may say the same)."""
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea-output", has_text=text).first


def _changed_grid(page, before_html: str, before_png: bytes, path, timeout_s: float = 50.0):
    """Wait (polling, 200 ms) until the grid differs from before in its HTML and in its pixels.

    Both, because either alone misleads: an HTML change can be invisible (a hover title), and
    the grid can change between a screenshot and the next read of its HTML. Returns (png, html), the
    last ones seen, so the caller's comparison fails when nothing changed in ``timeout_s``.
    """
    grid = page.locator(GRID)
    deadline = time.monotonic() + timeout_s
    html, png = before_html, before_png
    while True:
        html = grid.inner_html()
        if html != before_html:
            png = grid.screenshot(path=path)
            if png != before_png:
                return png, html
        if time.monotonic() > deadline:
            return png, html
        page.wait_for_timeout(200)


def _grid_state(page, path):
    """(png, html) of the grid: the HTML read after the screenshot, so that a later change of the
    HTML is also a change since the pixels were taken."""
    grid = page.locator(GRID)
    png = grid.screenshot(path=path)
    return png, grid.inner_html()


@pytest.mark.timeout(2400)
def test_block_grid_renders_and_changes_while_busy_and_after_in_jupyterlab(lab_server, browser, tmp_path):
    require_default_model()
    _copy_with_rounds(lab_server["root"], ROUNDS)
    background, busy, final = _cell_index("background"), _cell_index("busy"), _cell_index("final")
    shots = tmp_path / "screenshots"
    shots.mkdir()

    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    try:
        page.goto(f"{lab_server['base']}/lab/tree/02_dashboard.ipynb?token={lab_server['token']}")
        # The toolbar's indicator reads idle before the kernel is connected; the status bar text does not.
        page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=600_000)
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.keyboard.press("Escape")
        _run_cells(page, busy + 1)  # through the busy cell; the rest later

        page.locator(GRID).wait_for(timeout=600_000)
        _output(page, background, "requests queued").wait_for(timeout=600_000)
        page.locator(IN_USE_CELL).first.wait_for(timeout=300_000)

        # While the busy cell runs (kernel busy), the grid changes between two screenshots.
        busy_1, html_1 = _grid_state(page, shots / "busy-1.png")
        busy_2, html_2 = _changed_grid(page, html_1, busy_1, shots / "busy-2.png")
        page.screenshot(path=shots / "busy-page.png")
        assert "*" in _prompt(page, busy), "the busy cell finished before the second screenshot"
        assert html_1 != html_2 and busy_1 != busy_2, "block grid did not change while the cell was busy"

        # After it returns (kernel idle), background requests still run and the grid still changes.
        page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=600_000)
        assert "*" not in _prompt(page, busy)
        idle_1, html_3 = _grid_state(page, shots / "idle-1.png")
        _save_docs_picture(page.locator(".hfcb-dashboard").screenshot(), "dashboard.png")  # preemptions by now
        assert IN_USE_TITLE.search(html_3), (
            "no block in use after the busy cell: the background requests ended too soon"
        )
        idle_2, html_4 = _changed_grid(page, html_3, idle_1, shots / "idle-2.png")
        page.screenshot(path=shots / "idle-page.png")
        assert html_3 != html_4 and idle_1 != idle_2, "block grid did not change after the cell returned"

        # The rest of the notebook: wait for the background requests, stop, refresh, summary.
        _run_cells(page, final - busy)
        _output(page, final, f"finished {32 * ROUNDS + 6}").wait_for(timeout=1_200_000)  # a loaded machine: ~60 tok/s
        assert page.locator(IN_USE_CELL).count() == 0, "blocks still in use after every request finished"
        page.screenshot(path=shots / "final-page.png", full_page=True)
        assert page.locator(".jp-OutputArea-output", has_text="Traceback").count() == 0
    finally:
        page.close()
        keep = os.environ.get("HF_CONTBATCH_SCREENSHOTS")  # copy the screenshots out to look at them
        if keep:
            shutil.copytree(shots, keep, dirs_exist_ok=True)
        print(f"screenshots in {shots}")


# A new user's first notebook: the default pool (sized from max_num_seqs x the model's context), a
# display cell, a submit cell, a wait cell printing the summary, and close(). 24 x 480 tokens: still
# running when the grid is measured (about 2 s after the first block shows) on a fast CPU, where
# 24 x 160 tokens finished within the 1.5 s wait (900 was safe too, but the summary cell waited for it).
FIRST_NOTEBOOK = [
    "import hf_contbatch\npipe = hf_contbatch.pipeline('text-generation')\ndash = pipe.dashboard(refresh_hz=4)\ndash",
    "handles = [pipe.submit(f'Topic {i}:', max_new_tokens=480, do_sample=False, ignore_eos=True) for i in range(24)]",
    "results = [h.result() for h in handles]\nprint(dash.summary())",
    "pipe.close()",
]
DEVICE_IN_USE = GRID + " .hfcb-device .hfcb-grid i[title*='request']"


def _tile(page, label: str) -> str:
    return page.locator(f".hfcb-tile:has(small:text-is('{label}')) b").first.inner_text()


@pytest.mark.timeout(1500)
def test_default_pool_grid_is_readable_and_no_number_is_stale(lab_server, browser, tmp_path):
    import nbformat

    require_default_model()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in FIRST_NOTEBOOK]
    nbformat.write(nb, lab_server["root"] / "first.ipynb")
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    try:
        # A workspace of its own: the default one reopens the other test's notebook beside this one.
        page.goto(f"{lab_server['base']}/lab/workspaces/first/tree/first.ipynb?token={lab_server['token']}")
        page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=600_000)
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.keyboard.press("Escape")
        _run_cells(page, 2)  # display, then submit

        # The default pool has thousands of blocks; the in-use ones are drawn one a cell, readable.
        page.locator(DEVICE_IN_USE).first.wait_for(timeout=600_000)
        page.wait_for_timeout(1500)
        # The grid is redrawn 4 times a second: a cell found can be replaced before it is measured
        # (bounding_box() is then None), so measure the first cell of a frame that holds still.
        box = None
        for _ in range(50):
            box = page.locator(DEVICE_IN_USE).first.bounding_box()
            if box is not None:
                break
            page.wait_for_timeout(50)
        assert box is not None and box["width"] >= 8 and box["height"] >= 8, box
        assert page.locator(DEVICE_IN_USE).count() >= 24  # one cell per block: at least one per request
        header = page.locator(GRID + " .hfcb-device h4").inner_text()
        total = int(re.search(r"/([\d,]+) in use", header).group(1).replace(",", ""))
        assert total >= 4096, header  # the default pool, far larger than what is drawn
        assert "have never been used" in page.locator(GRID + " .hfcb-device").inner_text()
        page.screenshot(path=tmp_path / "default-pool-busy.png")

        # Every handle returned: summary() in the same cell is a fresh snapshot.
        _run_cells(page, 1)
        out = _output(page, 2, "finished 24")
        out.wait_for(timeout=900_000)
        assert "waiting 0 · running 0 · swapped 0 · finished 24" in out.inner_text()
        assert "tok/s now" not in out.inner_text()

        # Idle: "tokens/s now" reads "—" (the last burst's rate is not "now").
        deadline = time.monotonic() + 50
        while _tile(page, "tokens/s now") != "—" and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert _tile(page, "tokens/s now") == "—"

        # After close(): the last frame says closed and shows nothing in flight.
        _run_cells(page, 1)
        page.locator(".hfcb-dashboard", has_text="closed").first.wait_for(timeout=300_000)
        page.wait_for_timeout(500)
        assert _tile(page, "running") == "0" and _tile(page, "waiting") == "0"
        assert _tile(page, "tokens/s now") == "—"
        assert page.locator(DEVICE_IN_USE).count() == 0
        assert page.locator(".hfcb-dashboard .widget-label", has_text="tokens (in").first.inner_text().startswith("0/")
        page.screenshot(path=tmp_path / "default-pool-closed.png", full_page=True)
        assert page.locator(".jp-OutputArea-output", has_text="Traceback").count() == 0
    finally:
        page.close()
