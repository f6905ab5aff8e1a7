"""`glyd serve MODEL ... --kv MODE`: Glyd's option in any position, and the API's model id the name the user
gave. The command line `glyd serve` would exec is captured and parsed by vLLM's own `serve` parser (the one
that refused `--kv` as ambiguous), so what is checked is what vLLM would run with."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from glyd_engine.cli import main
from glyd_engine.commands.serve import served_name, take_glyd_options
from glyd_engine.errors import GlydError
from tests.tiny_models import make_tiny_llama


def vllm_serve_parser() -> argparse.ArgumentParser:
    from glyd_engine import vllm_cli

    vllm_cli.install_metadata_alias()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subparser"))
    return root


def exec_line(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment `glyd serve` hands to execve, without replacing this process."""
    seen: dict[str, Any] = {}

    def fake_execve(path: str, cmd: list[str], env: dict[str, str]) -> None:
        seen.update(cmd=cmd, env=env)

    monkeypatch.setattr(os, "execve", fake_execve)
    assert main(["serve", *argv]) == 0
    return seen["cmd"], seen["env"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "my-model")


def test_kv_after_the_model_reaches_vllm_and_the_id_is_the_given_name(
        monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    parser = vllm_serve_parser()
    with pytest.raises(SystemExit):  # what the user hit: vLLM's parser takes --kv for an abbreviation
        parser.parse_args(["serve", str(model_dir), "--kv", "lossless"])
    monkeypatch.setenv("GLYD_KV", "exact")
    for argv in ([str(model_dir), "--kv", "lossless", "--port", "9"], [str(model_dir), "--port", "9", "--kv=lossless"],
                 ["--kv", "off", str(model_dir), "--kv", "lossless", "--port", "9"]):
        cmd, env = exec_line(monkeypatch, argv)
        ns = parser.parse_args(cmd[3:])
        assert ns.model_tag == str(model_dir) and ns.port == 9
        assert ns.additional_config == {"glyd": {"kv": "lossless"}}
        assert ns.served_model_name == ["my-model"]
        assert "GLYD_KV" not in env  # --kv is the setting
    cmd, _ = exec_line(monkeypatch, [str(model_dir), "--served-model-name", "mine"])
    assert parser.parse_args(cmd[3:]).served_model_name == ["mine"]  # the user's own name stands


def test_served_names_and_bad_kv_values(tmp_path: Path) -> None:
    assert served_name("demo") == "demo"
    assert served_name("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"
    (tmp_path / "Qwen3-0.6B").mkdir()
    assert served_name(str(tmp_path / "Qwen3-0.6B") + "/") == "Qwen3-0.6B"
    assert take_glyd_options(["--port", "1", "--", "--kv", "x"]) == (None, ["--port", "1", "--", "--kv", "x"])
    assert take_glyd_options(["--kv-cache-dtype", "auto"]) == (None, ["--kv-cache-dtype", "auto"])
    with pytest.raises(GlydError, match="invalid choice 'fast'"):
        take_glyd_options(["--kv", "fast"])
    with pytest.raises(GlydError, match="--kv needs a mode"):
        take_glyd_options(["--kv", "--port", "1"])


def test_serving_a_glyd_checkpoint_on_the_cpu_build_warns_and_names_its_bf16_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], model_dir: Path, tmp_path: Path) -> None:
    packed = tmp_path / "my-model-glyd"
    assert main(["pack", str(model_dir), str(packed)]) == 0
    capsys.readouterr()
    exec_line(monkeypatch, [str(packed), "--port", "9"])
    err = capsys.readouterr().err
    assert "glyd: warning: my-model-glyd is a Glyd checkpoint" in err and "0.1-0.4 tokens a second" in err
    assert f"its bf16 model is {model_dir}" in err  # packed from it by path: known here
    exec_line(monkeypatch, [str(model_dir), "--port", "9"])
    assert "warning" not in capsys.readouterr().err  # a bf16 model: no word
