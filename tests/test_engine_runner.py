"""The engine runner: protocol, child process lifecycle, failures as events; and once on real vLLM.

Most tests run the real child process with the echo backend (GLYD_ENGINE_BACKEND=echo: same events,
no model) so pipes, crashes and restarts are tested in seconds; `test_real_vllm_*` (slow) runs vLLM's
CPU build on the demo model.
"""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest

from glyd_engine.engine import protocol as p
from glyd_engine.engine.child import classify, user_message
from glyd_engine.engine.client import EngineClient
from glyd_engine.errors import GlydError, OfflineError, UnsupportedModelError
from glyd_engine.progress import Cancelled


class Recorder:
    def __init__(self) -> None:
        self.q: queue.Queue[p.Event] = queue.Queue()
        self.seen: list[p.Event] = []

    def __call__(self, ev: p.Event) -> None:
        self.q.put(ev)

    def until(self, kind: type, timeout: float = 30.0) -> p.Event:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            self.seen.append(ev)
            if isinstance(ev, kind):
                return ev

    def of(self, kind: type) -> list:
        return [e for e in self.seen if isinstance(e, kind)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


@pytest.fixture
def echo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[EngineClient, Recorder]:
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GLYD_ENGINE_BACKEND", "echo")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    rec = Recorder()
    client = EngineClient(rec)
    client.model_dir = str(model)  # type: ignore[attr-defined]
    yield client, rec
    client.shutdown(5)


def test_protocol_round_trips_every_message() -> None:
    reqs = [
        p.Start("demo", p.EngineSettings(kv="off", max_model_len=512)),
        p.Generate("r1", [{"role": "user", "content": "hi"}], p.GenerationParams(0.1, 0.5, 7, "sys")),
        p.StopGeneration("r1"),
        p.CancelStart(),
        p.Shutdown(),
    ]
    for r in reqs:
        assert p.decode_request(p.encode(r)) == r
    events = [
        p.Progress("engine", "x", 1, 2, 3.0),
        p.Ready(model="m", kv_capacity_tokens=5),
        p.Delta("r", "é", 1),
        p.Stats("r", 1, 2, 3.0, 4.0, 0.5, 3, 10, 1, True),
        p.Finished("r", "stop"),
        p.Error("boom", "oom", True, "r", "/x.log"),
        p.Stopped(0),
    ]
    for e in events:
        assert p.decode_event(p.encode(e)) == e


def test_errors_are_classified_for_the_user() -> None:
    assert user_message(Cancelled("cancelled")) == "start cancelled"  # not "Cancelled: cancelled"
    assert classify(OfflineError("x")) == "offline"
    assert classify(UnsupportedModelError("x")) == "unsupported"
    assert classify(Cancelled()) == "cancelled"
    assert classify(MemoryError()) == "oom"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate")) == "oom"
    assert classify(ValueError("Model architectures ['Foo'] are not supported for now")) == "unsupported"
    assert classify(ValueError("glyd refused: tensor parallel > 1")) == "refused"
    assert classify(RuntimeError("segfault-ish")) == "crash"
    # Glyd's own errors are classified by their class, whatever their message says
    assert classify(GlydError("refused: lossless needs KV tables")) == "refused"
    assert classify(GlydError("the tables hold no architectures")) == "refused"
    assert classify(UnsupportedModelError("out of memory? no: a float32 tensor")) == "unsupported"
    try:
        try:
            raise GlydError("the real reason")
        except GlydError as inner:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from inner
    except RuntimeError as outer:
        assert user_message(outer) == "the real reason"


def test_every_error_class_carries_a_kind_the_protocol_names() -> None:
    from glyd_engine import errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.GlydError)]
    assert classes and all(c.kind in errors.KINDS for c in classes)


def test_echo_start_generate_stop_shutdown(echo: tuple[EngineClient, Recorder]) -> None:
    client, rec = echo
    client.start(client.model_dir, p.EngineSettings(kv="off"))  # type: ignore[attr-defined]
    ready = rec.until(p.Ready)
    assert ready.kv_capacity_tokens == 8192 and rec.of(p.Progress)
    rid = client.generate([{"role": "user", "content": "hello world"}], p.GenerationParams(max_tokens=50))
    fin = rec.until(p.Finished)
    assert fin.id == rid and fin.reason == "stop"
    assert "".join(d.text for d in rec.of(p.Delta)) == "You said: hello world "
    assert rec.of(p.Stats)[-1].final
    rid = client.generate([{"role": "user", "content": "SLOW please"}])
    rec.until(p.Delta)
    client.stop_generation()
    fin = rec.until(p.Finished)
    assert (fin.id, fin.reason) == (rid, "stopped")
    pid = client.pid
    client.shutdown()
    stopped = rec.until(p.Stopped)
    assert stopped.exit_code == 0 and not client.running and pid is not None and not _alive(pid)
    assert not rec.of(p.Error)


def test_child_dying_mid_reply_is_reported_and_restartable(echo: tuple[EngineClient, Recorder]) -> None:
    client, rec = echo
    client.start(client.model_dir)  # type: ignore[attr-defined]
    rec.until(p.Ready)
    rid = client.generate([{"role": "user", "content": "CRASH now"}])
    err = rec.until(p.Error)
    assert err.kind == "crash" and err.fatal and "exit code 3" in err.message and err.id == rid
    assert "RuntimeError: the echo backend was asked to crash" in err.message  # the log's exception, not its last line
    fin = rec.until(p.Finished)
    assert (fin.id, fin.reason) == (rid, "error")
    rec.until(p.Stopped)
    assert not client.running
    client.start(client.model_dir)  # type: ignore[attr-defined]
    rec.until(p.Ready)
    client.generate([{"role": "user", "content": "again"}])
    assert rec.until(p.Finished).reason == "stop"


def test_a_killed_engine_is_named_as_stopped_by_a_signal(echo: tuple[EngineClient, Recorder]) -> None:
    """A SIGKILL (the OOM killer, kill -9) is reported as such, not as the log's unrelated last warning."""
    client, rec = echo
    client.start(client.model_dir)  # type: ignore[attr-defined]
    rec.until(p.Ready)
    client.generate([{"role": "user", "content": "KILL now"}])
    err = rec.until(p.Error)
    assert err.fatal and "stopped by SIGKILL" in err.message and "unrelated warning" not in err.message
    assert err.kind == "signal"  # no OOM kill was counted meanwhile: not called "out of memory"
    assert rec.until(p.Stopped).exit_code == -9


def test_exit_reasons_follow_the_evidence(tmp_path: Path) -> None:
    """A SIGKILL is out of memory only where the cgroup counted an OOM kill; an exit code quotes the log's
    last exception line; a MemoryError there is out of memory."""
    from glyd_engine.engine.exit_reason import exit_error, oom_kills

    assert oom_kills() is None or oom_kills() >= 0
    log = tmp_path / "engine.log"
    log.write_text("INFO loading\nTraceback (most recent call last):\n  File \"x\"\n"
                   "ValueError: bad block size\nWARNING something unrelated\n")
    assert exit_error(-9, 4, 5, log).kind == "oom"
    killed = exit_error(-9, 4, 4, log)
    assert killed.kind == "signal" and "SIGKILL" in killed.message
    assert exit_error(-9, None, None, None).kind == "signal"
    crashed = exit_error(1, 0, 0, log, "r1")
    assert crashed.kind == "crash" and "ValueError: bad block size" in crashed.message and crashed.id == "r1"
    log.write_text("torch.OutOfMemoryError: tried to allocate 2 GiB\n")
    assert exit_error(1, None, None, log).kind == "oom"
    assert "its log says why" in exit_error(2, None, None, tmp_path / "absent.log").message


@pytest.mark.parametrize("kind", ["oom", "unsupported", "offline", "refused"])
def test_failed_start_is_an_event_with_its_kind(echo: tuple[EngineClient, Recorder], kind: str) -> None:
    client, rec = echo
    client.start(f"fail:{kind}")
    err = rec.until(p.Error)
    assert err.kind == kind and err.fatal and err.message
    assert rec.until(p.Stopped).exit_code == 0
    assert len(rec.of(p.Error)) == 1  # no second "unexpected exit" on top


def test_missing_model_directory_is_reported(echo: tuple[EngineClient, Recorder], tmp_path: Path) -> None:
    client, rec = echo
    client.start(str(tmp_path / "nowhere" / "model"))
    err = rec.until(p.Error)
    assert err.fatal and "does not exist" in err.message
    rec.until(p.Stopped)


def test_a_damaged_weight_file_is_named(echo: tuple[EngineClient, Recorder], tmp_path: Path) -> None:
    """A safetensors header whose offsets run past the file (a truncated or damaged download) is named as
    damaged before any loader sees it (vLLM's loader said `OverflowError: cannot fit 'int' ...`)."""
    import json
    import struct

    client, rec = echo
    model = tmp_path / "damaged"
    model.mkdir()
    (model / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 10**19]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))
    client.start(str(model))
    err = rec.until(p.Error)
    assert err.fatal and "model.safetensors is damaged" in err.message and "Overflow" not in err.message
    rec.until(p.Stopped)


def test_engine_output_never_reaches_our_stdout(
    echo: tuple[EngineClient, Recorder], capfd: pytest.CaptureFixture[str]
) -> None:
    client, rec = echo
    client.start("fail:crash")
    rec.until(p.Stopped)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ---------------------------------------------------------------------------------------- real vLLM


@pytest.mark.slow
def test_real_vllm_streams_stops_and_exits(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GLYD_ENGINE_BACKEND", raising=False)
    rec = Recorder()
    client = EngineClient(rec)
    try:
        client.start(str(demo_model_dir), p.EngineSettings(kv="off", max_model_len=1024))
        ready = rec.until(p.Ready, timeout=300)
        assert ready.device == "cpu" and ready.kv_capacity_tokens > 1000
        assert ready.kv_bytes_per_token == ready.kv_bf16_bytes_per_token == 2 * 30 * 3 * 64 * 2
        assert ready.weights_bytes > 200e6 and ready.kv_mode == "off" and ready.kv_reason
        assert {e.phase for e in rec.of(p.Progress)} >= {"Loading the weights"}
        client.generate(
            [{"role": "user", "content": "What is the capital of France?"}],
            p.GenerationParams(temperature=0.0, max_tokens=24),
        )
        fin = rec.until(p.Finished, timeout=120)
        text = "".join(d.text for d in rec.of(p.Delta))
        assert fin.reason in ("stop", "length") and "Paris" in text
        stats = rec.of(p.Stats)[-1]
        assert stats.final and stats.prompt_tokens > 10 and stats.gen_tps and stats.ttft_s
        client.generate(
            [{"role": "user", "content": "Write a very long story about a dragon."}],
            p.GenerationParams(max_tokens=500),
        )
        rec.until(p.Delta, timeout=60)
        client.stop_generation()
        fin = rec.until(p.Finished, timeout=60)
        assert fin.reason == "stopped" and rec.of(p.Stats)[-1].generated_tokens < 500
        pid = client.pid
        client.shutdown()
        rec.until(p.Stopped, timeout=30)
        assert pid is not None and not _alive(pid)
        assert not rec.of(p.Error)
    finally:
        client.shutdown(5)


def test_engine_python_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Homebrew installs carry no vLLM: then the engine venv under the data dir, once it is complete."""
    import sys

    from glyd_engine.engine import install

    monkeypatch.setenv("GLYD_HOME", str(tmp_path))
    monkeypatch.delenv("GLYD_ENGINE_PYTHON", raising=False)
    monkeypatch.delenv("GLYD_ENGINE_BACKEND", raising=False)
    monkeypatch.setattr(install, "has_vllm_here", lambda: False)
    assert not install.engine_available() and install.engine_python() == sys.executable
    venv = install.engine_venv()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert not install.engine_available()  # a half-made venv does not count
    (venv / install.MARKER).write_text("glyd[cpu]==0.1.0\n")
    assert install.engine_available() and install.engine_python() == str(venv / "bin" / "python")
    monkeypatch.setenv("GLYD_ENGINE_PYTHON", "/opt/py/bin/python")
    assert install.engine_python() == "/opt/py/bin/python"
    monkeypatch.setenv("GLYD_ENGINE_SOURCE", "/src/glyd")
    assert install.install_spec("cpu") == "/src/glyd[cpu]"


def test_replies_sample_with_the_models_defaults_and_a_fresh_seed() -> None:
    """The model's generation_config (as vLLM reads it) is the default, the user's settings win, and every
    reply gets its own seed unless the user fixed one (vLLM's engine seed made every home's reply the same)."""
    from glyd_engine.engine.vllm_backend import sampling_kwargs

    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 50}
    kw = sampling_kwargs(p.GenerationParams(max_tokens=512), defaults, room=100)
    assert (kw["temperature"], kw["top_p"], kw["repetition_penalty"], kw["max_tokens"]) == (0.2, 0.9, 1.1, 100)
    seeds = {sampling_kwargs(p.GenerationParams(), defaults, 100)["seed"] for _ in range(8)}
    assert len(seeds) == 8
    mine = sampling_kwargs(p.GenerationParams(temperature=0.0, top_p=0.5, seed=7), defaults, 100)
    assert (mine["temperature"], mine["top_p"], mine["seed"]) == (0.0, 0.5, 7)
    assert "temperature" not in sampling_kwargs(p.GenerationParams(), {}, 100)  # vLLM's neutral default


def test_one_steady_eta_per_phase() -> None:
    """No estimate from start-up noise; a steady rate gives a true ETA; a slowdown moves it step by step and
    is fully in it after the window."""
    from glyd_engine.progress import PhaseTimer

    now = [0.0]
    events: list = []
    timer = PhaseTimer("kv-tables", "calibrating", 200, events.append, clock=lambda: now[0])
    for i in range(1, 51):  # 1 unit a second
        now[0] = float(i)
        timer.update(i)
        if i == 2:
            assert events[-1].eta_s is None  # before 3 s: no estimate from start-up noise
    assert abs(events[-1].eta_s - 150) < 1  # 150 units left at 1 a second
    etas = []
    for i in range(51, 151):  # the machine gets busy: 1 unit every 2 s
        now[0] += 2.0
        timer.update(i)
        etas.append(events[-1].eta_s)
    assert all(b >= a - 2 for a, b in zip(etas, etas[1:], strict=False))  # no jumping back and forth
    assert abs(etas[-1] - 100) < 3  # 50 units left at 2 s: the window holds only the new speed


def test_uneven_units_give_a_steady_eta() -> None:
    """A table build's calibration runs cost unevenly (here 2 s and 10 s in turn, a warm-up first): the
    predicted finish (now + ETA) stays within 20% of the real one from the first estimate on and within 5% from
    the tenth (a rate smoothed over seconds swung from 1000 s to 224 s and by 10-25% to the end)."""
    from glyd_engine.progress import PhaseTimer

    now = [0.0]
    events: list = []
    timer = PhaseTimer("kv-tables", "calibrating", 40, events.append, clock=lambda: now[0])
    finishes = []
    for i in range(40):
        now[0] += 25.0 if i == 0 else (2.0 if i % 2 else 10.0)
        timer.update(i + 1)
        if events[-1].eta_s is not None and i < 39:
            finishes.append(now[0] + events[-1].eta_s)
    assert len(finishes) >= 30
    assert all(abs(f / now[0] - 1) < 0.2 for f in finishes), [round(f) for f in finishes]
    assert all(abs(f / now[0] - 1) < 0.05 for f in finishes[10:]), [round(f) for f in finishes]


def test_weights_are_reported_as_the_engine_holds_them(tmp_path: Path) -> None:
    """An fp32 checkpoint run as bf16 holds half its file: the report says both dtypes and the held size."""
    import torch
    from safetensors.torch import save_file

    from glyd_engine.engine.report import weights_report

    save_file({"w": torch.zeros(256, 256), "n": torch.zeros(256, dtype=torch.int64)}, str(tmp_path / "m.safetensors"))
    r = weights_report(tmp_path, run_bytes=2)
    assert r.dtype == "float32" and r.file_bytes == 256 * 256 * 4 + 256 * 8
    assert r.bytes == r.bf16_bytes == 256 * 256 * 2 + 256 * 8  # held as bf16 (not the file's 4 bytes a value)
