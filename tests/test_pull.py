"""`glyd models pull` and hub downloads against a local stand-in of the hub (tests/fake_hub.py, HF_ENDPOINT):
a whole pull, a resume after a broken connection (a Range request for the rest), refusals of an unsupported
architecture and of a model that does not fit memory, all decided before any weight is fetched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub, tiny_model

from glyd_engine.cli import main
from glyd_engine.errors import GlydError, UnsupportedModelError
from glyd_engine.models import MARKER, hub_model_path, list_local_models, resolve_model
from glyd_engine.models.pull import ModelTooLargeError, plan_pull, pull
from glyd_engine.models.ranged_download import DownloadBrokeOff
from glyd_engine.progress import ProgressEvent

PLENTY = (64 << 30, "free RAM")
FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]


def plenty() -> tuple[int, str]:
    return PLENTY


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("glyd_engine.models.fit.machine_memory", plenty)
    server = FakeHub({"org/tiny": tiny_model(), "org/bert": tiny_model("BertModel")})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.close()


def test_pull_downloads_a_tiny_model_with_progress_and_lists_it(hub: FakeHub, capsys: pytest.CaptureFixture) -> None:
    assert main(["models", "pull", "org/tiny"]) == 0
    out, err = capsys.readouterr()
    target = hub_model_path("org/tiny")
    assert out.strip().splitlines()[-1] == str(target)
    assert "org/tiny: LlamaForCausalLM, 3 MiB in 4 files" in err and "fits" in err and "100.0%" in err
    for name in FILES:
        assert (target / name).read_bytes() == hub.repos["org/tiny"][name]
    assert not (target / "README.md").exists() and not list(target.parent.glob(".*partial"))
    assert json.loads((target / MARKER).read_text())["repo_id"] == "org/tiny"
    assert [(m.name, m.kind) for m in list_local_models()] == [("org--tiny", "downloaded")]
    assert all(r == "" for n in FILES for r in hub.file_gets(n))  # whole files, no ranges
    calls = len(hub.requests)
    assert resolve_model("org/tiny") == target  # the engine's path: present, so no network
    assert main(["models", "pull", "org/tiny"]) == 0 and len(hub.requests) == calls + 2  # looks, fetches nothing


def test_a_broken_download_resumes_with_a_range_request(hub: FakeHub) -> None:
    hub.cut_after["model.safetensors"] = 1_500_000
    plan = plan_pull("org/tiny")
    with pytest.raises(DownloadBrokeOff, match="broke off at 1,500,000 of 3,000,0") as err:
        pull(plan)
    assert "pull again to resume" in str(err.value)
    partial = hub_model_path("org/tiny").with_name(".org--tiny.partial")
    assert (partial / "model.safetensors.part").stat().st_size == 1_500_000
    assert not hub_model_path("org/tiny").exists()
    events: list[ProgressEvent] = []
    target = pull(plan_pull("org/tiny"), progress=events.append)
    assert hub.file_gets("model.safetensors") == ["", "bytes=1500000-"]
    assert [len(hub.file_gets(n)) for n in FILES[1:3]] == [1, 1]  # finished files are not fetched again
    assert (target / "model.safetensors").read_bytes() == hub.repos["org/tiny"]["model.safetensors"]
    assert "resuming" in events[0].phase and events[1].done >= 1_500_000 and events[-1].fraction == 1.0


def test_a_server_that_ignores_the_range_and_a_damaged_file(hub: FakeHub) -> None:
    hub.cut_after["model.safetensors"] = 1_000_000
    with pytest.raises(DownloadBrokeOff):
        pull(plan_pull("org/tiny"))
    hub.ignore_range = True  # answers 200 with the whole file: it is taken whole, not appended
    hub.corrupt.add("model.safetensors")
    with pytest.raises(GlydError, match="arrived damaged"):
        pull(plan_pull("org/tiny"))
    hub.corrupt.clear()
    target = pull(plan_pull("org/tiny"))
    assert (target / "model.safetensors").read_bytes() == hub.repos["org/tiny"]["model.safetensors"]


def test_unsupported_architecture_is_refused_before_any_weight(hub: FakeHub, capsys: pytest.CaptureFixture) -> None:
    plan = plan_pull("org/bert")
    assert plan.refusal is not None and "BertModel is not a text-generation architecture vLLM runs" in plan.refusal
    with pytest.raises(UnsupportedModelError, match="org/bert is not supported: BertModel"):
        pull(plan)
    assert main(["models", "pull", "org/bert"]) == 2
    assert "org/bert is not supported: BertModel is not a text-generation architecture" in capsys.readouterr().err
    with pytest.raises(UnsupportedModelError, match="BertModel"):
        resolve_model("org/bert")  # the engine's start refuses it the same way
    assert hub.file_gets("model.safetensors") == [] and not hub_model_path("org/bert").exists()


def test_a_model_that_does_not_fit_is_refused_unless_asked(hub: FakeHub, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    plan = plan_pull("org/tiny", probe=lambda: (512 << 20, "free RAM"))
    assert plan.refusal is None and not plan.fit.fits
    assert plan.fit.describe() == "needs about 1.3 GiB, 512 MiB free RAM: does not fit"
    with pytest.raises(ModelTooLargeError, match="does not fit this machine") as err:
        pull(plan)
    assert err.value.kind == "oom"
    monkeypatch.setattr("glyd_engine.models.fit.machine_memory", lambda: (512 << 20, "free RAM"))
    assert main(["models", "pull", "org/tiny"]) == 2
    assert "--ignore-memory" in capsys.readouterr().err
    assert hub.file_gets("model.safetensors") == []
    assert main(["models", "pull", "org/tiny", "--ignore-memory"]) == 0
    assert hub_model_path("org/tiny").is_dir()


def test_unknown_repo_and_unreachable_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GlydError, match="no model named org/nope"):
        plan_pull("org/nope")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(GlydError, match="unreachable"):
        plan_pull("org/tiny")


def test_page_head_sizes_agree_with_the_page_code() -> None:
    from glyd_engine.format.kv_page import HEAD_SIZES
    from glyd_engine.models.support import PAGE_HEAD_SIZES

    assert PAGE_HEAD_SIZES == HEAD_SIZES
