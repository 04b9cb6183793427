"""The import structure: no circles, kernels at the bottom, ipc a leaf, memory importing only downward,
and an API process without torch (issue #15). Every import statement counts, lazy ones inside functions
and TYPE_CHECKING ones too: a circle through a lazy import is still a circle for a reader."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"dsv4serve": REPO / "dsv4serve", "dsv4_kernels": REPO / "kernels" / "dsv4_kernels"}


def _module_name(root: str, path: Path) -> str:
    rel = path.relative_to(ROOTS[root]).with_suffix("")
    parts = [root, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(root, p): p for root, base in ROOTS.items() for p in base.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (`from a.b import c` names a.b.c when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_edge(a: str, b: str) -> bool:
    """A package's __init__ and its own submodules (importing a submodule runs the package first)."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = {m: {i for i in deps if not _is_package_edge(m, i)} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_kernels_import_nothing_of_the_server():
    offenders = {
        m: sorted(d)
        for m, d in _graph().items()
        if m.startswith("dsv4_kernels") and any(i.startswith("dsv4serve") for i in d)
    }
    assert offenders == {}


def test_ipc_is_a_leaf():
    offenders = {
        m: sorted(i for i in d if not i.startswith("dsv4serve.ipc"))
        for m, d in _graph().items()
        if m.startswith("dsv4serve.ipc")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_memory_imports_only_downward():
    below = (
        "dsv4serve.memory",
        "dsv4serve.config",
        "dsv4serve.resolve",
        "dsv4serve.ipc",
        "dsv4serve.units",
        "dsv4serve.model.args",
        "dsv4serve.model.schema",
        "dsv4serve.model.backends",
    )
    offenders = {
        m: sorted(i for i in d if i.startswith("dsv4serve") and not i.startswith(below))
        for m, d in _graph().items()
        if m.startswith("dsv4serve.memory")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_api_process_never_imports_torch():
    """The app, the server, the supervisor and the command line import without torch (the worker, spawned
    by module name, is the only process that loads the model stack)."""
    code = (
        "import sys\n"
        "import dsv4serve.api.app, dsv4serve.api.server, dsv4serve.supervisor, dsv4serve.cli\n"
        "print(sorted(m for m in ('torch', 'triton', 'dsv4serve.model.transformer', 'dsv4serve.worker.main')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
