"""Refusals keep their kind (issue 31, item 2): a RefusedError raised in the plugin reaches the front end as a
refusal, with its reason and what to do instead apart, however vLLM wrapped it on the way (pydantic's
ValidationError around its config check, an engine-start error raised from it). The real engine's refusals are
tests/vllm/test_refusals.py; here the child process runs the echo stand-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from glyd_engine.engine import protocol as p
from glyd_engine.engine.child import classify, failure
from glyd_engine.engine.client import EngineClient
from glyd_engine.engine.echo_backend import as_vllm_config_check_raises
from glyd_engine.errors import RefusedError
from tests.test_engine_runner import Recorder

REFUSAL = RefusedError("Glyd KV cache (kv=lossless) cannot run this engine: the model has sliding-window "
                       "attention layers", "change that, or run with GLYD_KV=off to use vLLM's own cache")


def _raised_from(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise outer from exc
    except Exception as got:  # noqa: BLE001
        return got


@pytest.mark.parametrize("how", ["itself", "pydantic", "raised from"])
def test_a_refusal_is_found_however_vllm_wrapped_it(how: str) -> None:
    exc = {"itself": REFUSAL, "pydantic": as_vllm_config_check_raises(REFUSAL),
           "raised from": _raised_from(RuntimeError("Engine core initialization failed"), REFUSAL)}[how]
    if how == "pydantic":
        assert type(exc).__name__ == "ValidationError"  # what vLLM's config raises, not a cause chain
    ev = failure(exc, fatal=True)
    assert (ev.kind, ev.message, ev.fix) == ("refused", REFUSAL.reason, REFUSAL.fix)
    assert classify(exc) == "refused"


def test_other_failures_keep_their_kind_and_have_no_fix() -> None:
    ev = failure(RuntimeError("CUDA error: an illegal memory access"), fatal=True)
    assert ev.kind == "crash" and ev.fix == "" and "illegal memory access" in ev.message


def test_the_fix_crosses_the_wire() -> None:
    ev = p.decode_event(p.encode(p.Error(REFUSAL.reason, "refused", fix=REFUSAL.fix)))
    assert isinstance(ev, p.Error) and ev.fix == REFUSAL.fix and ev.message == REFUSAL.reason


def test_a_plugin_refusal_reaches_the_front_end_as_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real child process: the stand-in raises the refusal inside pydantic's ValidationError, as
    vLLM's config check hands it on; the client gets one refusal event with the reason and the fix."""
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GLYD_ENGINE_BACKEND", "echo")
    rec = Recorder()
    client = EngineClient(rec)
    try:
        client.start("fail:refused")
        err = rec.until(p.Error)
        assert isinstance(err, p.Error) and err.fatal
        assert err.kind == "refused" and "sliding-window attention layers" in err.message
        assert "ValidationError" not in err.message and "GLYD_KV=off" in err.fix
        rec.until(p.Stopped)
        assert len(rec.of(p.Error)) == 1
    finally:
        client.shutdown(5)
