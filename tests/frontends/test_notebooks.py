"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (nbclient), offline, on the embedded
default model; assertions read the saved outputs and the saved widget state (nb.metadata.widgets)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re

import pytest

from jupyter_fixtures import (
    NOTEBOOKS,
    ROOT,
    WIDGET_VIEW,
    cell_by_tag,
    cell_text,
    jupyter_env,
    models_with_class,
    require_default_model,
    widget_models,
)

NOTEBOOK_NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))

# nbformat (and nbclient) are imported in the functions that use them: with jsonschema they take about
# 3-4 s to import, which every pytest-xdist worker would pay when it collects this module.


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict:
    """Every notebook run at once, each in a fresh python3 kernel of its own (cwd notebooks/):
    ``{name: executed notebook, or the exception its run raised}``. A kernel's run is mostly
    importing torch on one core: two cores run the three side by side in less time than one after
    another."""
    import nbformat
    from nbclient import NotebookClient

    require_default_model()
    state = tmp_path_factory.mktemp("jupyter-state")

    async def run_all() -> list:
        clients = [
            NotebookClient(
                nbformat.read(NOTEBOOKS / name, as_version=4),
                timeout=900,
                startup_timeout=450,
                kernel_name="python3",
                resources={"metadata": {"path": str(NOTEBOOKS)}},
            )
            for name in NOTEBOOK_NAMES
        ]
        return await asyncio.gather(*(c.async_execute() for c in clients), return_exceptions=True)

    with pytest.MonkeyPatch.context() as mp:
        for var, value in jupyter_env(state).items():
            mp.setenv(var, value)  # the kernels inherit them: no state in $HOME, this checkout importable
        return dict(zip(NOTEBOOK_NAMES, asyncio.run(run_all())))


def execute(executed: dict, name: str):
    """notebooks/<name> as its kernel left it (the run's own exception if it failed)."""
    nb = executed[name]
    if isinstance(nb, BaseException):
        raise nb
    return nb


def widget_views(cell) -> list[str]:
    return [o["data"][WIDGET_VIEW]["model_id"] for o in cell.get("outputs", []) if WIDGET_VIEW in o.get("data", {})]


@pytest.mark.timeout(120)
def test_three_notebooks_are_committed_without_outputs():
    import nbformat

    assert NOTEBOOK_NAMES == ["01_quickstart.ipynb", "02_dashboard.ipynb", "03_static_vs_continuous.ipynb"]
    for name in NOTEBOOK_NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert "widgets" not in nb.metadata, f"{name}: saved widget state committed"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs committed"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quickstart_matches_transformers_pipeline_and_shows_progress(executed):
    nb = execute(executed, "01_quickstart.ipynb")
    assert "identical greedy outputs: True" in cell_text(cell_by_tag(nb, "compare"))

    # tqdm.auto chose its notebook bar (a widget) and the saved state shows it complete: 4 of 4 requests.
    bar_ids = widget_views(cell_by_tag(nb, "progress"))
    assert bar_ids, "no progress-bar widget in the multi-prompt call's output"
    models = widget_models(nb)
    bars = [m["state"] for m in models.values() if m["model_name"] == "FloatProgressModel"]
    assert any(b["max"] == 4 and b["value"] == 4 for b in bars), bars

    quiet = cell_by_tag(nb, "quiet")
    assert quiet.outputs == [], f"progress_bar=False still printed: {quiet.outputs}"
    assert cell_text(cell_by_tag(nb, "stream")), "streaming printed nothing"
    stats = cell_text(cell_by_tag(nb, "stats"))
    assert "KV blocks" in stats
    if hasattr(os, "getloadavg"):  # the speeds printed with the load they were measured under (issue 48)
        assert re.search(r"tok/s average .* · load \d+\.\d\d on \d+ cores?", stats), stats


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dashboard_notebook_saves_final_state_with_preemptions_and_no_leaked_block(executed):
    nb = execute(executed, "02_dashboard.ipynb")
    assert widget_views(cell_by_tag(nb, "setup")), "pipe.dashboard() as the last expression displayed no widget"

    (grid,) = models_with_class(nb, "hfcb-block-grid")
    assert "KV blocks · 0/48 in use" in grid["value"]  # every block free once every request finished
    assert grid["value"].count("<i") >= 48  # one cell per block (the pool has 48)

    (bar,) = [
        m["state"]
        for m in widget_models(nb).values()
        if m["model_name"] == "IntProgressModel" and m["state"].get("description") == "KV blocks"
    ]
    assert (bar["value"], bar["max"]) == (0, 48)

    (tiles,) = models_with_class(nb, "hfcb-tiles-widget")
    count = {label: int(v) for label, v in re.findall(r"<small>(\w+)</small><b>(\d+)</b>", tiles["value"])}
    assert count["finished"] == 32 + 6 and count["waiting"] == count["running"] == 0
    assert count["preempted"] > 0, "the 48-block pool should force preemptions"

    (phases,) = models_with_class(nb, "hfcb-phases-widget")
    assert all(p in phases["value"] for p in ("reap", "budget", "admit", "preempt", "decode"))

    summary = cell_text(cell_by_tag(nb, "final"))
    assert re.search(r"finished 38 · preempted [1-9]", summary), summary
    assert "0/48 used" in summary


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_static_vs_continuous_notebook_plots_both_runs(executed):
    nb = execute(executed, "03_static_vs_continuous.ipynb")
    plot = cell_by_tag(nb, "plot")
    pngs = [o["data"]["image/png"] for o in plot.outputs if "image/png" in o.get("data", {})]
    assert pngs, "no matplotlib figure"
    if os.environ.get("HF_CONTBATCH_UPDATE_DOCS") == "1":  # the README's picture, from this run
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(pngs[0]))).convert("RGB").quantize(64)
        (ROOT / "docs").mkdir(exist_ok=True)
        image.save(ROOT / "docs" / "static_vs_continuous.png", optimize=True)
        print(cell_text(plot))  # the figures that go beside the picture
    text = cell_text(plot)
    rates = dict(re.findall(r"^(static|continuous):.*?([\d.]+) tokens/s", text, flags=re.M))
    assert set(rates) == {"static", "continuous"}, text
    utilisation = dict(re.findall(r"^(static|continuous):.*slots in use (\d+)%", text, flags=re.M))
    # Arithmetic, not timing: batches of 4 with lengths (8,8,64,8) (16,8,8,32) (8,16,8,64) (8,8,16,8) keep
    # 288 of 64*4 + 32*4 + 64*4 + 16*4 = 704 slot-steps busy.
    assert utilisation["static"] == "41"
