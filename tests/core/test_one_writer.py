"""One writer per request field, read off the package's source with ``ast`` (nothing runs): only
``core/request_state.py`` (the scheduler's ``RequestState``, called under the engine's state lock)
assigns ``status`` or ``num_computed_tokens`` and changes ``output_token_ids``; every other module
asks the scheduler or returns a decision (``StopDecision``). And only ``core/`` reaches that
writer: the engine goes through the scheduler's methods."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_contbatch"
OWNER = "core/request_state.py"
FIELDS = ("status", "num_computed_tokens", "output_token_ids")
# Methods that change a list in place.
LIST_MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
}


def _field_of(node: ast.AST):
    """The field name when ``node`` is ``<x>.<field>`` or ``<x>.<field>[...]``, else None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        return node.attr
    return None


def writes_in(source: str) -> list[tuple[int, str]]:
    """``(line, field)`` of every write of a guarded field in ``source``: an assignment (plain,
    augmented, annotated) to ``x.field`` or ``x.field[...]``, a ``del`` of either, or an in-place
    list method called on ``x.output_token_ids``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LIST_MUTATORS
            and _field_of(node.func.value) == "output_token_ids"
        ):
            found.append((node.lineno, "output_token_ids"))
        for target in targets:
            for t in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                name = _field_of(t)
                if name is not None:
                    found.append((node.lineno, name))
    return found


def test_only_the_request_state_writes_status_computed_tokens_and_output_tokens():
    writers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        got = writes_in(path.read_text())
        if got:
            writers[rel] = sorted({name for _, name in got})
    assert writers == {OWNER: sorted(FIELDS)}


def imports_request_state(source: str) -> bool:
    """True when ``source`` imports the ``request_state`` module or a name from it."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if (node.module or "").endswith("request_state") or any(a.name == "request_state" for a in node.names):
                return True
        elif isinstance(node, ast.Import) and any(a.name.endswith("request_state") for a in node.names):
            return True
    return False


def test_only_core_reaches_the_writer():
    users = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if imports_request_state(path.read_text())
    ]
    assert "core/scheduler.py" in users
    assert [u for u in users if not u.startswith("core/")] == []
    assert not imports_request_state('"""The writer is core.request_state.RequestState."""')
    assert imports_request_state("from .core import request_state")


def test_the_check_sees_every_kind_of_write():
    source = """
req.status = s
req.num_computed_tokens += 1
a.b.num_computed_tokens: int = 0
req.output_token_ids.append(t)
req.output_token_ids.extend(ts)
del req.output_token_ids[3:]
req.output_token_ids[0] = 1
req.output_token_ids += [1]
x, req.status = 1, s
n = len(req.output_token_ids)
req.output_token_ids.count(1)
other.state = 1
"""
    assert [name for _, name in sorted(writes_in(source))] == [
        "status",
        "num_computed_tokens",
        "num_computed_tokens",
        "output_token_ids",
        "output_token_ids",
        "output_token_ids",
        "output_token_ids",
        "output_token_ids",
        "status",
    ]
