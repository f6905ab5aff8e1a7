"""No import circle in the house: glyd_engine, glyd_app, the kernels (the folder kernels/, installed as glyd_kernels)
and the benchmarks in bench/, read from the source (ast), so nothing is imported and no GPU is needed.

Every import counts: at the top, inside a function, under TYPE_CHECKING (a circle that only a type checker sees is
still one a reader has to untangle), and importing a.b.c counts as importing a and a.b too (but not a module's own
parent packages, which run first anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> its folder (pyproject's package-dir maps glyd_kernels to kernels/)
PACKAGES = {"glyd_engine": "glyd_engine", "glyd_app": "glyd_app", "glyd_kernels": "kernels", "bench": "bench"}


def module_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = (package, *path.relative_to(ROOT / folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(tree: ast.AST, lazy: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module: with `lazy`, those inside functions too."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if lazy or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, path: Path, known: set[str], lazy: bool = True) -> set[str]:
    """The house's modules `name` (at `path`) imports, with `from pkg import module` resolved to the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), filename=str(path)), lazy):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            bases = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for imported in bases:
            parts = imported.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    # a package's own parents run before it whatever it imports: an edge to one is no circle (a package's
    # __init__ that re-exports its submodules is the usual facade)
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files), lazy) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert {"bench.gpu_pools", "bench.gpu_model", "bench.gpu_graph", "glyd_kernels.kv_cuda"} <= graph["bench.gpu"]
    assert "glyd_kernels.nvrtc" in graph["glyd_kernels.kv_cuda"]  # `from glyd_kernels import nvrtc`
    assert "glyd_kernels.kv_layer" in graph["glyd_engine.vllm_plugin.gpu_backend"]  # inside a function


def test_the_house_imports_in_no_circle() -> None:
    """No circle through what a module imports when it loads (its top level and TYPE_CHECKING), anywhere."""
    assert find_cycle(import_graph(lazy=False)) is None


def test_no_circle_even_through_imports_inside_functions() -> None:
    """Counting imports inside functions too: none anywhere (the plugin's settings derive refusals from
    page_facts, which imports nothing of the plugin)."""
    assert find_cycle(import_graph()) is None


def test_the_benchmarks_share_their_types_through_one_module() -> None:
    """bench/gpu.py runs the throughput model and the graph steps; they take its pools' types from gpu_pools."""
    graph = import_graph()
    assert "bench.gpu" not in graph["bench.gpu_model"] | graph["bench.gpu_graph"]
    assert "bench.gpu_pools" in graph["bench.gpu_model"] & graph["bench.gpu_graph"]
