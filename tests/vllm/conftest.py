"""The real vLLM engine (CPU build) on the demo model. Each engine runs in a child process
(glyd_engine.bench.kv): vLLM spawns processes and keeps global state. Engines are started once a session
and shared by the tests that read their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_HOME

SKIP_ENV = "GLYD_SKIP_ENGINE_TESTS"
NOT_RUN = ""  # why the engine tests are not collected (only ever with SKIP_ENV=1)
try:  # the engine suite is the product's proof: a vLLM that does not import fails the run, unless told to skip
    import vllm  # noqa: F401
except Exception as exc:
    if os.environ.get(SKIP_ENV) != "1":
        raise RuntimeError(f"vLLM does not import ({type(exc).__name__}: {exc}); the engine tests in tests/vllm "
                           f"need it (`make test` installs it). Set {SKIP_ENV}=1 to skip them knowingly.") from exc
    NOT_RUN = f"vLLM does not import ({exc}) and {SKIP_ENV}=1"
    collect_ignore_glob = ["test_*.py"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if NOT_RUN:
        terminalreporter.write_line(f"tests/vllm NOT RUN: {NOT_RUN}", yellow=True, bold=True)


HERE = Path(__file__).resolve().parent
KV_BYTES = 160 * 1024 * 1024  # fixed KV memory for off and Glyd alike: 56 blocks of 128 tokens off
MAX_LEN = 7040  # what vLLM's own cache can serve in KV_BYTES (55 usable blocks of 128)
LONG = 896  # prompt logprobs over 7 blocks, prefilled in chunks of 400, 400, 96: later ones read the earlier pages
CHUNK = 400  # tokens a step for the LONG engines (bf16 prefill runs ~35 tokens a second on a 2-core CI machine)
GREEDY = {"prompts": [40, 200], "max_tokens": 12}
PREFIX = {"n": 14, "prefix": 200, "tail": 20, "max_tokens": 8}


@pytest.fixture(autouse=True, scope="session")
def _glyd_home() -> Any:
    """Children inherit GLYD_HOME: the KV tables cached next to the demo model are reused."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLYD_HOME", str(TEST_HOME))
        mp.delenv("GLYD_KV", raising=False)
        yield


def run_configs(cases: dict[str, dict[str, Any]], without_hook: str | None = None) -> dict[str, dict[str, Any]]:
    """Engine configs built in a child (no engine start): what Glyd decided for each case (`without_hook`: in a
    vLLM whose AttentionBackend lacks that method)."""
    extra = ["--without", without_hook] if without_hook else []
    proc = subprocess.run([sys.executable, str(HERE / "config_child.py"), json.dumps(cases), *extra],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    logs: dict[str, list[str]] = {}
    current: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith("GLYD_CASE "):
            current = logs.setdefault(line.split(" ", 1)[1], [])
        elif line.startswith("GLYD_RESULT "):
            result = json.loads(line[len("GLYD_RESULT "):])
            for name, r in result.items():
                r["log"] = "\n".join(logs.get(name, []))
            return result
        else:
            current.append(line)
    raise AssertionError(f"config child failed rc={proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine in a child, with vLLM's engine core inside it (`one_schedule`; a single worker runs there too):
    one or two fewer processes importing vLLM (~17 s each on a 2-core CI machine), and every prompt queued before
    the first step, so each engine's schedule is the same run to run."""
    from glyd_engine.bench.kv import run_engine

    return run_engine({"kv_bytes": KV_BYTES, "one_schedule": True, **spec}, timeout=900)


@pytest.fixture(scope="session")
def off(demo_model_dir: Path) -> dict[str, Any]:
    """vLLM as it ships: the bf16 demo model with vLLM's own KV cache (the reference for every comparison)."""
    return engine({"model": demo_model_dir, "mode": "off", "max_model_len": MAX_LEN, "max_num_batched_tokens": CHUNK,
                   "work": {"logprobs": [LONG], "greedy": GREEDY, "prefix": PREFIX}})
