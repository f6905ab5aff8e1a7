"""The architecture's two rules: the engine never imports Textual; the app never loads torch or vLLM."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "vllm", "transformers")


def test_app_start_up_imports_no_torch_vllm_or_transformers() -> None:
    code = (
        "import sys, json\n"
        "import glyd_app.__main__, glyd_app.app\n"
        "from glyd_app.app import GlydApp\n"
        "app = GlydApp()\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_engine_client_imports_no_torch_or_vllm() -> None:
    code = (
        "import sys, json\n"
        "import glyd_engine.engine, glyd_engine.engine.client, glyd_engine.engine.child, glyd_engine.models\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY + ('textual',)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_no_module_under_glyd_engine_imports_textual_or_the_app() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & {"textual", "glyd_app"})
        for p in (ROOT / "glyd_engine").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


# ---------------------------------------------------------------- the app's own layering

APP = ROOT / "glyd_app"
# What screens and widgets may know of glyd_engine: the protocol's plain data, the KV modes' names and
# the model catalogue (names, the demo id; the picker lists it). The engine client, the runner and its
# errors stay behind the session and the app.
APP_CONTRACT = ("glyd_engine.engine.protocol", "glyd_engine.kv_mode", "glyd_engine.models")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top, inside functions or under TYPE_CHECKING (a circle that
    only type checkers see is still one), with `from pkg import module` resolved to the module."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            for alias in node.names:
                sub = ROOT.joinpath(*f"{base}.{alias.name}".split("."))
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    found.add(f"{base}.{alias.name}")
    return found


def _app_import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in APP.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for imported in _imported_modules(path):
            parts = imported.split(".")
            # importing a.b.c runs a and a.b first
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_glyd_app_modules_import_in_no_circle() -> None:
    graph = _app_import_graph()
    assert "glyd_app.screens.chat" in graph["glyd_app.app"]  # the graph sees `from x.y import Z`
    assert _find_cycle(graph) is None


def test_the_apps_screens_and_widgets_import_no_engine_internals() -> None:
    offenders = {}
    for path in [*APP.glob("screens/*.py"), *APP.glob("widgets/*.py")]:
        engine = {m for m in _imported_modules(path) if m.split(".")[0] == "glyd_engine"}
        bad = {m for m in engine if not any(m == c or m.startswith(c + ".") for c in APP_CONTRACT)}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_the_chat_session_imports_no_screen_or_widget() -> None:
    drawn = ("glyd_app.screens", "glyd_app.widgets", "glyd_app.app", "textual.screen", "textual.widget",
             "textual.widgets", "textual.app")
    imported = _imported_modules(APP / "session.py")
    assert "glyd_app.store" in imported
    assert sorted(m for m in imported if m.startswith(drawn)) == []


def test_importing_the_chat_session_loads_no_textual() -> None:
    """The session (and the store, the engine client it uses) runs without the UI: a test or another front end can
    drive a conversation with no Textual installed."""
    code = ("import sys, json\nimport glyd_app.session\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'textual')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_only_the_session_touches_the_chat_store() -> None:
    """One writer of the app's state: the app, its screens and widgets reach the chat store only through the
    session's methods, never as `.store` (nor import the Store to make their own)."""
    offenders = {}
    for path in [APP / "app.py", *APP.glob("screens/*.py"), *APP.glob("widgets/*.py")]:
        tree = ast.parse(path.read_text(), filename=str(path))
        uses = sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in (
            "store", "_store")})
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert offenders == {}
