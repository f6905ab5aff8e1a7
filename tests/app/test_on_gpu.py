"""glyd-chat and `glyd serve` on an NVIDIA GPU with vLLM's CUDA build (skipped elsewhere: CI has no GPU).

Run on the GPU machine (bench/device_setup.sh stages the project and the demo model):
    python3 -m pytest -q -p no:cacheprovider tests/app/test_on_gpu.py
The app's engine runs the lossless KV cache on the GPU (Glyd's CUDA kernels inside vLLM, its defaults: compiled,
CUDA graphs); Pilot asks a question, reads the reply and the numbers on screen, switches the KV mode to vLLM's own
cache and quits, and the engine process is gone. The server answers a real `openai` client, streamed, and refuses a
prompt its limited overflow arena cannot hold.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for
from test_real_engine import SIZE, _gone, _ready, _send

from glyd_app.app import GlydApp
from glyd_app.store import Store
from glyd_app.widgets.stats_bar import StatsBar
from glyd_engine.engine.protocol import EngineSettings
from tests.conftest import stop_server

pytestmark = [pytest.mark.anyio, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU")]
KV_BYTES = 2 << 30
ARENA_MB = "0.004"  # 2,000 entries a layer (the first arena, at this limit): a chat fits, 800 rare tokens do not
# with the 3-bit code
RARE_TOKENS = 800


async def test_app_answers_on_the_gpu_switches_the_kv_mode_and_quits(demo_model_dir: Path, tmp_path: Path) -> None:
    app = GlydApp(model="demo", settings=EngineSettings(kv="lossless", kv_cache_bytes=KV_BYTES),
                  store=Store(tmp_path / "chats.sqlite3"), export_dir=tmp_path, install_if_missing=False)
    async with app.run_test(size=SIZE) as pilot:
        await _ready(pilot, app)
        ready = app.session.ready_info
        assert ready is not None and ready.device != "cpu" and ready.kv_mode == "lossless", ready
        lossless_tokens = ready.kv_capacity_tokens
        reply = await _send(pilot, app, "What is the capital of France?")
        assert "Paris" in reply.content, reply.content
        bar = app.chat_screen.query_one(StatsBar).render().plain
        assert "tok/s" in bar and "– tok/s" not in bar.split("·")[1] and "weights " in bar and "KV" in bar, bar
        first_pid = app.session.engine.pid  # type: ignore[union-attr]

        app.settings.kv = "off"  # what the KV-mode screen does once the user confirms: new settings, new engine
        app.start_engine(app.model_spec)
        await wait_for(pilot, lambda: app.session.engine_state == "starting", 10)
        await _ready(pilot, app)
        ready = app.session.ready_info
        assert ready is not None and ready.kv_mode == "off" and _gone(first_pid)
        assert lossless_tokens > 1.3 * ready.kv_capacity_tokens, (lossless_tokens, ready.kv_capacity_tokens)
        reply = await _send(pilot, app, "What is the capital of France?")
        assert "Paris" in reply.content, reply.content
        last_pid = app.session.engine.pid  # type: ignore[union-attr]
        await pilot.press("ctrl+q")
    assert _gone(last_pid)


def test_glyd_serve_lossless_answers_a_streamed_chat_and_refuses_what_its_arena_cannot_hold(
        demo_model_dir: Path, tmp_path: Path) -> None:
    """The server on the GPU with its overflow arena limited (GLYD_KV_ARENA_MB, as in tests/vllm/test_serve.py): an
    ordinary chat is answered, streamed; a prompt of rare tokens is refused with its reason (the CUDA writer names
    the slots it could not store, the worker tells the scheduler: refusals.py); the next request is answered."""
    openai = pytest.importorskip("openai")
    from glyd_engine.bench.rare_tokens import find_rare_tokens, rare_prompts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = tmp_path / "serve.log"
    # the machine's own vLLM settings stay (a staged vLLM without FlashInfer needs VLLM_USE_FLASHINFER_SAMPLER=0);
    # the test's cache mode and the interpreter do not
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLYD_KV", "TRITON_INTERPRET"))}
    env["GLYD_KV_ARENA_MB"] = ARENA_MB
    env["GLYD_KV_CODE"] = "3"  # rare text overflows ~1% of its values (docs/benchmarks.md); the 4-bit code far less
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glyd_engine.cli", "serve", "--kv", "lossless", "demo",
                                 "--port", str(port), "--gpu-memory-utilization", "0.3"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"glyd serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(2)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        stream = client.chat.completions.create(model=model, stream=True, max_tokens=24, messages=question)
        chunks = [c for c in stream if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert len(chunks) > 3 and "Paris" in text, text
        text_log = log.read_text(errors="replace")
        assert "Glyd KV cache: lossless" in text_log and "cuda kernels" in text_log, text_log[-3000:]

        assert "overflow arenas of 30 layers take 0.1 MB" in text_log, text_log[-3000:]  # 2,000 entries a layer

        rare = rare_prompts([t["id"] for t in find_rare_tokens(demo_model_dir, 64)], 1, RARE_TOKENS)
        refused: Exception | None = None
        try:
            client.completions.create(model=model, prompt=rare[0], max_tokens=4, temperature=0)
        except openai.APIStatusError as exc:
            refused = exc
        assert refused is not None, f"not refused:\n{log.read_text(errors='replace')[-4000:]}"
        assert "overflow arena" in str(refused) and "GLYD_KV_ARENA_MB" in str(refused), refused
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.choices[0].text, out
    finally:
        stop_server(proc)
