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
