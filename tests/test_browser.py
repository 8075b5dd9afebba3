"""The dashboard notebook in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

The block grid must render and keep changing both while a cell is busy and after it has returned (the
refresher thread pushes updates in either state). Skips only when Chromium, JupyterLab or Playwright is
missing; .ci/install-browser.sh and the `dev` extra install them in CI.
"""

from __future__ import annotations

import os
import shutil
import time

import nbformat
import pytest

from jupyter_fixtures import NOTEBOOKS, browser_missing_reason, copy_notebook, require_default_model
from jupyter_fixtures import browser, lab_server  # noqa: F401 - fixtures used by name

_MISSING = browser_missing_reason()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

# The widget's element stays in the DOM; its contents are replaced on every update, so screenshots and
# HTML comparisons take the widget element.
GRID = ".hfcb-block-grid"
IN_USE_CELL = GRID + " .hfcb-device .hfcb-grid i[title*='request']"


def _cell_index(tag: str) -> int:
    nb = nbformat.read(NOTEBOOKS / "02_dashboard.ipynb", as_version=4)
    return next(i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", []))


def _run_cells(page, count: int) -> None:
    for _ in range(count):
        page.keyboard.press("Shift+Enter")


def _prompt(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text()


def _output(page, index: int, text: str):
    """The output of cell ``index`` containing ``text`` (not its source, which may say the same)."""
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea-output", has_text=text).first


def _changed_grid(page, before_html: str, path, timeout_s: float = 5.0):
    """Wait (polling, 200 ms) until the grid's HTML differs from ``before_html``; screenshot it then.
    Returns (png bytes, html); the HTML is unchanged if it never changed."""
    grid = page.locator(GRID)
    deadline = time.monotonic() + timeout_s
    html = grid.inner_html()
    while html == before_html and time.monotonic() < deadline:
        page.wait_for_timeout(200)
        html = grid.inner_html()
    return grid.screenshot(path=path), html


@pytest.mark.timeout(300)
def test_block_grid_renders_and_changes_while_busy_and_after_in_jupyterlab(lab_server, browser, tmp_path):
    require_default_model()
    copy_notebook("02_dashboard.ipynb", lab_server["root"])
    background, busy, final = _cell_index("background"), _cell_index("busy"), _cell_index("final")
    shots = tmp_path / "screenshots"
    shots.mkdir()

    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    try:
        page.goto(f"{lab_server['base']}/lab/tree/02_dashboard.ipynb?token={lab_server['token']}")
        # The toolbar's indicator reads idle before the kernel is connected; the status bar text does not.
        page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=120_000)
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.keyboard.press("Escape")
        _run_cells(page, busy + 1)  # through the busy cell; the rest later

        page.locator(GRID).wait_for(timeout=120_000)
        _output(page, background, "requests queued").wait_for(timeout=120_000)
        page.locator(IN_USE_CELL).first.wait_for(timeout=60_000)

        # While the busy cell runs (kernel busy), the grid changes between two screenshots.
        grid = page.locator(GRID)
        html_1 = grid.inner_html()
        busy_1 = grid.screenshot(path=shots / "busy-1.png")
        page.screenshot(path=shots / "busy-page.png")
        busy_2, html_2 = _changed_grid(page, html_1, shots / "busy-2.png")
        assert "*" in _prompt(page, busy), "the busy cell finished before the second screenshot"
        assert html_1 != html_2 and busy_1 != busy_2, "block grid did not change while the cell was busy"

        # After it returns (kernel idle), background requests still run and the grid still changes.
        page.locator(".jp-StatusBar-Widget", has_text="| Idle").first.wait_for(timeout=120_000)
        assert "*" not in _prompt(page, busy)
        html_3 = grid.inner_html()
        idle_1 = grid.screenshot(path=shots / "idle-1.png")
        assert "request" in html_3, "no block in use after the busy cell: the background requests ended too soon"
        idle_2, html_4 = _changed_grid(page, html_3, shots / "idle-2.png")
        page.screenshot(path=shots / "idle-page.png")
        assert html_3 != html_4 and idle_1 != idle_2, "block grid did not change after the cell returned"

        # The rest of the notebook: wait for the background requests, stop, refresh, summary.
        _run_cells(page, final - busy)
        _output(page, final, "finished 38").wait_for(timeout=120_000)
        assert page.locator(IN_USE_CELL).count() == 0, "blocks still in use after every request finished"
        page.screenshot(path=shots / "final-page.png", full_page=True)
        assert page.get_by_text("Traceback").count() == 0
    finally:
        page.close()
        keep = os.environ.get("HF_CONTBATCH_SCREENSHOTS")  # copy the screenshots out to look at them
        if keep:
            shutil.copytree(shots, keep, dirs_exist_ok=True)
        print(f"screenshots in {shots}")
