"""Every public name the documentation writes exists (issue 33): each ``hf_contbatch.…`` dotted name in
README.md, ARCHITECTURE.md, docs/*.md and the notebooks' cells (code and markdown) imports or is an
attribute of what it names, and each ``pipe.…`` / ``dash.…`` attribute chain resolves on a real
pipeline on the embedded model (``dash``: the ``Dashboard`` class)."""

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
CHAIN = re.compile(r"(?<![\w.])(pipe|dash)((?:\.[A-Za-z_]\w*)+)")


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


@pytest.mark.timeout(120)
def test_every_pipe_and_dashboard_attribute_in_the_docs_exists(pipe):
    roots = {"pipe": pipe, "dash": Dashboard}
    missing, checked = [], 0
    for doc, text in documents().items():
        for root, chain in sorted(set(CHAIN.findall(text))):
            obj = roots[root]
            for part in chain.strip(".").split("."):
                if obj is None:  # an optional part not built here (e.g. no tuner): nothing to follow
                    break
                if not hasattr(obj, part):
                    missing.append(f"{doc}: {root}{chain} (no {part!r} on {type(obj).__name__})")
                    break
                obj = getattr(obj, part)
                checked += 1
    assert checked > 5
    assert not missing, "\n".join(missing)
