"""The package's import graph, read with ``ast`` (no import runs): no circle among modules, and no
module imports from a layer above its own (ARCHITECTURE.md: root config/request <- core <- kernels
<- engine <- frontends). Every import statement counts, also those inside functions or under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_contbatch"
# Bottom up. The root package, ``cli`` and the ``integrations`` aliases face users, as the front ends do.
LAYERS = {
    "config": 0,
    "request": 0,
    "default_model": 0,
    "core": 1,
    "kernels": 2,
    "engine": 3,
    "frontends": 4,
    "integrations": 4,
    "cli": 4,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name inside a module resolves to the module)."""
    mods = _modules()

    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                origin = (base + ("." + node.module if node.module else "")) if node.level else node.module
                names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name and name.startswith("hf_contbatch") else None
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _layer(mod: str) -> int:
    parts = mod.split(".")
    return 4 if len(parts) == 1 else LAYERS[parts[1]]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package_and_its_imports():
    graph = _import_graph()
    assert {"hf_contbatch.engine.llm_engine", "hf_contbatch.core.scheduler", "hf_contbatch.frontends.pipeline"} <= set(
        graph
    )
    assert "hf_contbatch.engine.driver" in graph["hf_contbatch.engine.llm_engine"]
    assert "hf_contbatch.core.scheduler" in graph["hf_contbatch.engine.llm_engine"]


def test_no_import_circle_among_modules():
    assert _circles(_import_graph()) == []


def test_no_module_imports_from_a_higher_layer():
    graph = _import_graph()
    upward = sorted((a, b) for a, deps in graph.items() for b in deps if _layer(b) > _layer(a))
    assert upward == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.timeout(600)
def test_importing_the_package_loads_no_torch_and_each_name_on_first_use():
    code = (
        "import sys\nimport hf_contbatch\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'import hf_contbatch loaded torch'\n"
        "exported = {name: getattr(hf_contbatch, name) for name in hf_contbatch.__all__}\n"
        "subpackages = [hf_contbatch.core, hf_contbatch.kernels, hf_contbatch.engine, hf_contbatch.frontends]\n"
        "from hf_contbatch.engine import LLMEngine\n"
        "from hf_contbatch.frontends.pipeline import pipeline\n"
        "assert exported['LLMEngine'] is LLMEngine and exported['pipeline'] is pipeline\n"
        "assert hf_contbatch.integrations.TASK_NAME == 'continuous-batching-text-generation'\n"
        "namespace = {}\nexec('from hf_contbatch import *', namespace)\n"
        "assert set(hf_contbatch.__all__) <= set(namespace)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=500)


# The runner side of the step contract sees values only (StepPlan, NewRequestData, BatchRow).
VALUES_ONLY = ("engine/runner.py", "engine/sampler.py", "engine/input_batch.py", "engine/input_buffers.py", "kernels/")


def _request_uses(path: Path) -> list[str]:
    """Where ``path`` imports ``Request`` (from any module) or names it (annotations included)."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == "Request" for a in node.names):
            uses.append(f"line {node.lineno}: imports Request")
        elif isinstance(node, ast.Name) and node.id == "Request":
            uses.append(f"line {node.lineno}: names Request")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "Request":
            uses.append(f"line {node.lineno}: a 'Request' annotation")
    return uses


def test_the_runner_the_sampler_and_kernels_never_see_a_request():
    checked, found = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(VALUES_ONLY):
            checked.append(rel)
            uses = _request_uses(path)
            if uses:
                found[rel] = uses
    assert {"engine/runner.py", "engine/sampler.py", "kernels/lora.py"} <= set(checked)
    assert found == {}


def test_the_request_check_finds_an_import_and_an_annotation(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from ..request import Request, SamplingParams\ndef f(r: 'Request') -> None: ...\n")
    assert _request_uses(src) == ["line 1: imports Request", "line 2: a 'Request' annotation"]
