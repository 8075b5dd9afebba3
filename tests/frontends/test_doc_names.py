"""Every public name the documentation writes exists (issue 33): each ``hf_contbatch.…`` dotted name in
README.md, ARCHITECTURE.md, docs/*.md and the notebooks' cells (code and markdown) imports or is an
attribute of what it names, and each ``pipe.…`` / ``dash.…`` / ``handle.…`` attribute chain resolves
on a real pipeline on the embedded model after one call (``dash``: the ``Dashboard`` class;
``handle``: what ``pipe.submit`` returned), subscripts included (``handle.handles[0].result``,
``pipe.last_call_stats["seconds"]``)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

import hf_contbatch
from hf_contbatch import CacheConfig
from hf_contbatch.frontends.dashboard import Dashboard

ROOT = Path(__file__).resolve().parents[2]
MODULE_NAME = re.compile(r"(?<![\w./-])hf_contbatch(?:\.[A-Za-z_]\w*)+")
# root, then ".name" parts, each optionally followed by subscripts: [0], ["key"] or ['key']
CHAIN = re.compile(r"""(?<![\w.])(pipe|dash|handle)((?:\.[A-Za-z_]\w*(?:\[(?:\d+|"[^"\]]*"|'[^'\]]*')\])*)+)""")
PART = re.compile(r"""\.([A-Za-z_]\w*)|\[(\d+)\]|\[["']([^"'\]]*)["']\]""")


def documents() -> dict[str, str]:
    """Text of each document, by path relative to the repository root (a notebook: its cells)."""
    paths = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        texts[str(nb.relative_to(ROOT))] = "\n".join("".join(cell["source"]) for cell in cells)
    return texts


def resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    for part in parts[cut:]:
        obj = getattr(obj, part)
    return obj


def test_the_documents_are_found_and_name_the_package():
    texts = documents()
    assert {"README.md", "ARCHITECTURE.md", "notebooks/02_dashboard.ipynb"} <= set(texts)
    assert sum(len(MODULE_NAME.findall(t)) for t in texts.values()) >= 10


def test_every_hf_contbatch_name_in_the_docs_resolves():
    missing = []
    for doc, text in documents().items():
        for name in sorted(set(MODULE_NAME.findall(text))):
            try:
                resolve(name)
            except (ImportError, AttributeError) as exc:
                missing.append(f"{doc}: {name} ({type(exc).__name__}: {exc})")
    assert not missing, "\n".join(missing)


@pytest.fixture(scope="module")
def pipe():
    p = hf_contbatch.pipeline("text-generation", cache_config=CacheConfig(num_blocks=16))
    yield p
    p.close()


def follow(obj, chain: str):
    """Follow ``chain`` (".a[0].b["k"]") from ``obj``: ``(object reached, None)``, or ``(None, what
    is missing)`` at the first part that does not exist."""
    for attr, index, key in PART.findall(chain):
        if obj is None:  # an optional part not built here (e.g. no tuner): nothing to follow
            break
        if attr:
            if not hasattr(obj, attr):
                return None, f"no {attr!r} on {type(obj).__name__}"
            obj = getattr(obj, attr)
        elif index:
            if not 0 <= int(index) < len(obj):
                return None, f"no [{index}] in a {type(obj).__name__} of {len(obj)}"
            obj = obj[int(index)]
        else:
            if key not in obj:
                return None, f"no key {key!r} in {type(obj).__name__} {sorted(obj)}"
            obj = obj[key]
    return obj, None


@pytest.mark.timeout(600)
def test_every_pipe_dashboard_and_handle_attribute_in_the_docs_exists(pipe):
    pipe("Hello", max_new_tokens=2, progress_bar=False)  # fills pipe.last_call_stats
    handle = pipe.submit("Hello", max_new_tokens=2)
    handle.result(timeout=300)
    roots = {"pipe": pipe, "dash": Dashboard, "handle": handle}
    missing, checked = [], set()
    for doc, text in documents().items():
        for root, chain in sorted(set(CHAIN.findall(text))):
            _, why = follow(roots[root], chain)
            if why:
                missing.append(f"{doc}: {root}{chain} ({why})")
            checked.add(root + chain)
    assert len(checked) > 5
    # What README.md documents for the newcomer: a call's figures and one sequence's request.
    assert {"pipe.last_call_stats", "handle.handles[0].result", 'pipe.last_call_stats["ttft_s"]'} <= checked
    assert not missing, "\n".join(missing)


def test_a_missing_attribute_index_or_key_is_reported():
    stats = {"seconds": 1.0}
    assert follow(stats, '["seconds"]') == (1.0, None)
    assert follow([stats], "[0]['seconds']") == (1.0, None)
    assert follow(stats, '["secs"]')[1] == "no key 'secs' in dict ['seconds']"
    assert follow([stats], "[1]")[1] == "no [1] in a list of 1"
    assert follow(stats, ".nope")[1] == "no 'nope' on dict"


def test_every_jupyterlab_menu_item_the_docs_name_is_one_of_jupyterlabs_own():
    # A newcomer searched JupyterLab 4.6's context menu for "Create New View for Output"; it is
    # "Create New View for Cell Output". The labels are in JupyterLab's bundled JavaScript.
    jupyterlab = pytest.importorskip("jupyterlab")
    static = Path(jupyterlab.__file__).parent / "static"
    bundle = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in static.glob("*.js"))
    named = {
        label
        for text in documents().values()
        for label in re.findall(r"\*\*((?:Create|New|Open|Run|Restart|Clear|Show)\b[^*]*)\*\*", text)
    }
    assert "Create New View for Cell Output" in named, named
    assert [label for label in sorted(named) if label not in bundle] == []
