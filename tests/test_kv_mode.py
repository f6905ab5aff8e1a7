"""The KV mode in one place (glyd_engine/kv_mode.py): its list, its parser, its precedence, and the one way
every Glyd front end hands it to vLLM. No engine runs here."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from glyd_engine import kv_mode
from glyd_engine.engine.engine_args import engine_args, kv_cache_bytes
from glyd_engine.engine.protocol import EngineSettings

ROOT = Path(__file__).resolve().parents[1]


def _lists_the_modes(path: Path) -> bool:
    """Whether a source file writes a tuple/list/set literal (or a dict's keys) holding "lossless", "exact" and
    "off": a second map of the modes (the stats bar had one)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            words = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if {"lossless", "exact", "off"} <= words:
                return True
    return False


def test_the_mode_list_is_written_in_one_module() -> None:
    sources = [p for p in ROOT.rglob("*.py")
               if not {"tests", ".venv", ".cache", "build"} & set(p.relative_to(ROOT).parts[:-1])]
    assert len(sources) > 50  # the scan saw the source tree
    # The KV mode screen's per-mode cost text is the screen's own copy, looked up for every mode of kv_mode.MODES
    # (a mode without one fails at import); its names on screen are kv_mode.RUNNING's.
    copy = {"glyd_app/screens/kv_mode.py"}
    found = [str(p.relative_to(ROOT)) for p in sources if _lists_the_modes(p)]
    assert [f for f in found if f not in copy] == ["glyd_engine/kv_mode.py"]
    assert kv_mode.MODES == ("auto", "lossless", "exact", "off")


def test_a_bad_value_is_refused_naming_where_it_came_from_and_every_choice() -> None:
    assert kv_mode.parse(" Lossless ") == "lossless"
    with pytest.raises(ValueError) as err:
        kv_mode.parse("losless")
    assert str(err.value) == "GLYD_KV='losless' is not a Glyd KV mode; use one of auto, lossless, exact, off"
    with pytest.raises(ValueError, match=r"^additional_config glyd\.kv='fast' is not a Glyd KV mode; use one of"):
        kv_mode.asked({"kv": "fast"}, environ={})


def test_the_engines_own_setting_wins_over_glyd_kv_and_auto_is_the_default() -> None:
    env = {"GLYD_KV": "lossless"}
    assert kv_mode.asked({"kv": "off"}, environ=env) == "off"  # per engine wins over per process
    assert kv_mode.asked({}, environ=env) == "lossless"
    assert kv_mode.asked(None, environ={"GLYD_KV": ""}) == "auto"
    assert kv_mode.asked({"kv": "exact"}, environ={"GLYD_KV": "bogus"}) == "exact"  # the loser is not read
    assert kv_mode.additional_config("Exact", check=True) == {"glyd": {"kv": "exact", "check": True}}


@pytest.mark.parametrize("prog", ["glyd-chat", "glyd serve"])
def test_both_command_lines_take_the_modes_from_the_one_list(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    if prog == "glyd-chat":
        from glyd_app.__main__ import add_arguments

        parser = argparse.ArgumentParser(prog=prog)
        add_arguments(parser)
        parse = parser.parse_args
    else:
        from glyd_engine.commands.serve import add_parser

        parser = argparse.ArgumentParser(prog="glyd")
        add_parser(parser.add_subparsers())

        def parse(argv: list[str]) -> argparse.Namespace:
            return parser.parse_args(["serve", *argv, "demo"])
    for mode in kv_mode.MODES:
        assert parse(["--kv", mode]).kv == mode
    with pytest.raises(SystemExit):
        parse(["--kv", "fast"])
    err = capsys.readouterr().err  # argparse names the flag; the rest names the value and every mode
    assert "argument --kv" in err and all(mode in err.split("'fast'", 1)[1] for mode in kv_mode.MODES), err


def test_the_app_and_the_benches_build_engine_arguments_one_way() -> None:
    app = engine_args("/m", EngineSettings(kv="off", kv_cache_bytes=kv_cache_bytes(256)), cpu=True,
                      disable_log_stats=True)
    assert app == {"model": "/m", "dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True,
                   "additional_config": {"glyd": {"kv": "off"}}, "kv_cache_memory_bytes": 256 << 20,
                   "disable_log_stats": True}
    gpu = engine_args("/m", EngineSettings(kv_cache_bytes=kv_cache_bytes(0)), cpu=False, glyd={"check": True})
    assert gpu["enforce_eager"] is False and gpu["gpu_memory_utilization"] == 0.85
    assert "kv_cache_memory_bytes" not in gpu and gpu["additional_config"] == {"glyd": {"kv": "auto", "check": True}}
    with pytest.raises(ValueError, match="kv='losless' is not a Glyd KV mode"):  # a typo in config.toml
        engine_args("/m", EngineSettings(kv="losless"), cpu=True)  # type: ignore[arg-type]


def test_the_kv_budget_in_mib_becomes_bytes_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from glyd_app import config

    monkeypatch.setattr(config, "config_path", lambda: tmp_path / "config.toml")
    (tmp_path / "config.toml").write_text("[engine]\nkv_cache_mib = 128\n")
    assert config.load_engine_settings()[0].kv_cache_bytes == 128 << 20
    assert config.load_engine_settings(kv_cache_mib=512)[0].kv_cache_bytes == 512 << 20  # the command line wins
    assert config.load_engine_settings(kv_cache_mib=0)[0].kv_cache_bytes is None  # 0: vLLM sizes it (GPU)
    (tmp_path / "config.toml").write_text("[engine]\nkv = \"exact\"\n")
    assert config.load_engine_settings(kv_cache_mib=None)[0].kv_cache_bytes == EngineSettings().kv_cache_bytes
