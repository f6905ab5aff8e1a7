"""Settings parsed at the edge (issue 31, item 1): a bad value from each source where a Glyd setting enters (the
environment, vLLM's additional_config, a command line, config.toml) is one SettingError naming the source and
every value the setting takes, and each setting's names are written in one place. No engine runs here."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from glyd_engine import kv_mode, options
from glyd_engine.errors import GlydError, RefusedError, SettingError
from glyd_engine.vllm_plugin import settings

ROOT = Path(__file__).resolve().parents[1]
KV_VALUES = "use one of auto, lossless, exact, off"


def _engine(section: object = None) -> SimpleNamespace:
    return SimpleNamespace(additional_config={} if section is None else {"glyd": section})


@pytest.mark.parametrize(("env", "value", "what", "takes"), [
    ("GLYD_KV", "losless", "Glyd KV mode", KV_VALUES),
    ("GLYD_KV_CODE", "5", "Glyd KV code width", "use one of auto, 3, 4"),
    ("GLYD_KV_KERNELS", "triton", "Glyd kernel choice", "use one of auto, torch, cuda, reference"),
    ("GLYD_KV_CHECK", "maybe", "Glyd KV check switch", "use one of on, true, yes, 1, off, false, no, 0"),
    ("GLYD_WEIGHTS", "fast", "Glyd weights mode", "use one of auto, lossless, exact"),
    ("GLYD_WEIGHT_LAYOUT", "tiles", "Glyd weight layout", "use one of auto, resident, fragment"),
])
def test_a_bad_environment_value_names_the_variable_and_the_values(env: str, value: str, what: str,
                                                                    takes: str) -> None:
    with pytest.raises(SettingError) as err:
        settings.options(_engine(), environ={env: value})
    assert str(err.value) == f"{env}={value!r} is not a {what}; {takes}"
    assert err.value.reason == f"{env}={value!r} is not a {what}" and err.value.fix == takes


def test_a_bad_additional_config_value_names_its_key_and_the_values() -> None:
    with pytest.raises(SettingError) as err:
        settings.options(_engine({"code": 4.5}), environ={})
    assert str(err.value) == "additional_config glyd.code='4.5' is not a Glyd KV code width; use one of auto, 3, 4"
    with pytest.raises(SettingError) as err:
        settings.options(_engine({"kv": "fast"}), environ={})
    assert str(err.value) == f"additional_config glyd.kv='fast' is not a Glyd KV mode; {KV_VALUES}"
    with pytest.raises(SettingError, match=r"glyd\.kvv is not a Glyd setting; use arena_mb, check, code, kernels, "):
        settings.options(_engine({"kvv": "lossless"}), environ={})
    with pytest.raises(SettingError, match=r"additional_config glyd='lossless' is not a table of Glyd settings"):
        settings.options(_engine("lossless"), environ={})


def test_the_arena_limit_takes_megabytes_or_auto() -> None:
    assert settings.options(_engine({"arena_mb": 64}), environ={}).arena_mb == 64.0
    assert settings.options(_engine(), environ={"GLYD_KV_ARENA_MB": "0.5"}).arena_mb == 0.5
    assert settings.options(_engine(), environ={"GLYD_KV_ARENA_MB": "auto"}).arena_mb is None
    assert settings.arena_limit_entries(_engine({"arena_mb": 2})) == 1_000_000  # int16 entries
    for bad in ("0", "-3", "lots", "inf", "nan"):
        with pytest.raises(SettingError) as err:
            settings.options(_engine(), environ={"GLYD_KV_ARENA_MB": bad})
        assert str(err.value) == (f"GLYD_KV_ARENA_MB={bad!r} is not a Glyd overflow arena limit (MB a layer); use a "
                                  "number of MB greater than 0 (e.g. 512) or auto")


def test_the_engines_setting_wins_and_the_loser_is_not_read() -> None:
    env = {"GLYD_KV": "bogus", "GLYD_KV_CODE": "9", "GLYD_KV_CHECK": "on"}
    got = settings.options(_engine({"kv": "exact", "code": 4}), environ=env)
    assert got == settings.Options(kv="exact", code="4", check=True)
    assert settings.options(_engine(), environ={"GLYD_KV": ""}) == settings.Options()  # empty: unset


def test_a_bad_command_line_value_names_the_flag_and_the_values(capsys: pytest.CaptureFixture[str]) -> None:
    from glyd_app.__main__ import add_arguments

    parser = argparse.ArgumentParser(prog="glyd-chat")
    add_arguments(parser)
    assert parser.parse_args(["--kv", " Exact"]).kv == "exact"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv", "fast"])
    assert f"error: argument --kv: 'fast' is not a Glyd KV mode; {KV_VALUES}" in capsys.readouterr().err


def test_a_bad_config_toml_value_names_the_file_the_key_and_the_values(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    from glyd_app import config

    path = tmp_path / "config.toml"
    monkeypatch.setattr(config, "config_path", lambda: path)
    path.write_text('[engine]\nkv = "losless"\nmax_model_len = 2048\n')
    got, error = config.load_engine_settings()
    assert error == f"{path} [engine] kv='losless' is not a Glyd KV mode; {KV_VALUES}"
    assert got.kv == "auto" and got.max_model_len == 2048  # the bad value is left out, the rest kept
    assert config.load_engine_settings(kv="off")[0].kv == "off"  # the command line wins (and was parsed there)
    path.write_text('[engine]\nmax_model_len = "long"\nkv_cache_mib = -1\ncolour = "blue"\n')
    got, error = config.load_engine_settings()
    assert error is not None and got == config.EngineSettings()
    assert f"{path} [engine] max_model_len='long' is not valid; give a whole number of tokens" in error
    assert f"{path} [engine] kv_cache_mib=-1 is not valid; give a whole number of MiB" in error
    assert f"{path} [engine] colour is not an engine setting; use kv, max_model_len" in error


def test_the_engine_request_parses_its_settings() -> None:
    from glyd_engine.engine.protocol import EngineSettings

    assert EngineSettings.from_dict({"kv": "Lossless", "max_model_len": 512, "new_key": 1}).kv == "lossless"
    with pytest.raises(SettingError, match="^engine settings kv='fast' is not a Glyd KV mode"):
        EngineSettings.from_dict({"kv": "fast"})


def test_a_setting_error_is_a_refusal_and_a_value_error() -> None:
    """vLLM expects a ValueError from a config check; the app shows a refusal with its fix."""
    assert issubclass(SettingError, RefusedError) and issubclass(SettingError, ValueError)
    assert issubclass(SettingError, GlydError) and SettingError.kind == "refused"


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_each_settings_names_are_written_in_one_module() -> None:
    """The environment variables and additional_config keys of Glyd's settings are written where they are
    declared (options.py, kv_mode.py), so nothing else reads one by hand."""
    names = {s.env for s in (*options.PLUGIN, kv_mode.SETTING)}
    sources = [p for p in (ROOT / "glyd_engine").rglob("*.py")] + [p for p in (ROOT / "glyd_app").rglob("*.py")]
    where = {str(p.relative_to(ROOT)) for p in sources if names & _string_constants(p)}
    assert where == {"glyd_engine/options.py", "glyd_engine/kv_mode.py"}
