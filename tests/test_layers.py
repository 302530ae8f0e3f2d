"""ftctl's own modules form no import cycle: a lower module never reaches up to one that imports it.

The graph is read from the source with ``ast``, so an import inside a function counts as much as
one at the top (it still ties the two modules together), and importing ``ftctl.a.b`` also counts
as importing the package ``ftctl.a`` (Python runs its ``__init__`` first).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "ftctl"


def module_files(source: Path = SOURCE) -> dict:
    files = {}
    for path in source.rglob("*.py"):
        parts = list(path.relative_to(source.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _with_packages(name: str, known) -> list:
    """``name`` (trimmed to the deepest module ftctl has) and every package above it."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    found = []
    while name:
        if name in known:
            found.append(name)
        name = name.rpartition(".")[0]
    return found


def import_graph(source: Path = SOURCE) -> dict:
    files = module_files(source)
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                targets.update(_with_packages(name, files))
        # A package's own parents run before it; importing itself or a parent is not a cycle of its making.
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_ftctl_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in ftctl (move the shared piece into a lower module):\n" + "\n".join(
        " <-> ".join(c) for c in found)


@pytest.mark.parametrize("inside_function", [False, True])
def test_the_walk_sees_a_cycle_through_a_package_or_a_function(tmp_path, inside_function):
    """The walk itself can fail: two modules that import each other (one through its package, at the
    top or inside a function) are reported."""
    pkg = tmp_path / "ftctl"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "base.py").write_text(
        ("def f():\n    from ftctl.high import thing\n" if inside_function else "from ftctl.high import thing\n"))
    (pkg / "high.py").write_text("from ftctl.low.base import f\nthing = 1\n")
    (pkg / "alone.py").write_text("from . import high\n")
    assert cycles(import_graph(pkg)) == [["ftctl.high", "ftctl.low.base"]]
