"""`glyd pack` / `glyd verify` on real model directories: bit-exact, refusals, corruption named."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glyd_engine.atomic import DiskFullError
from glyd_engine.errors import CorruptFileError, GlydError, MismatchError, UnsupportedModelError
from glyd_engine.format.checkpoint import pack_model, read_header, verify_model
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def packed(tiny, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dst") / "tiny-glyd"
    pack_model(tiny, dst)
    return dst


def test_pack_then_verify_against_source(tiny, packed):
    cfg = json.loads((packed / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "glyd"
    report = verify_model(packed, against=tiny)
    assert report.compared == report.checked == len(load_file(str(tiny / "model.safetensors")))
    assert report.tensors and all(bits < 16 for _, _, bits in report.tensors)
    # Every tensor of the source comes back with the same bits.
    src = load_file(str(tiny / "model.safetensors"))
    assert (packed / "generation_config.json").exists()
    assert sum(1 for n in src if n.endswith("norm.weight")) > 0


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.mark.parametrize("part", ["_glyd_sm", "_glyd_exp"])
def test_one_flipped_byte_is_caught_and_named(packed, tmp_path, part):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    f = next(bad.glob("glyd-*.safetensors"))
    header = read_header(f)
    name = next(n for n in header if n.endswith(part) and "mlp" in n)
    start, end = header[name]["data_offsets"]
    flip_byte(f, data_start(f) + (start + end) // 2)
    with pytest.raises(CorruptFileError, match=name.removesuffix(part)):
        verify_model(bad)


def test_flipped_plain_tensor_is_caught(packed, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    f = next(bad.glob("glyd-*.safetensors"))
    header = read_header(f)
    name = next(n for n in header if n.endswith("norm.weight"))
    start, _ = header[name]["data_offsets"]
    flip_byte(f, data_start(f) + start)
    with pytest.raises(CorruptFileError, match=name):
        verify_model(bad)


def test_truncated_file_is_an_error(packed, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    f = next(bad.glob("glyd-*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptFileError):
        verify_model(bad)


def test_verify_against_a_different_model_names_the_tensor(packed, tmp_path):
    other = make_tiny_llama(tmp_path / "other", seed=1)
    with pytest.raises(MismatchError, match="differ"):
        verify_model(packed, against=other)


def test_fp32_model_is_refused(tmp_path):
    src = make_tiny_llama(tmp_path / "fp32", dtype="float32")
    with pytest.raises(UnsupportedModelError, match="bf16"):
        pack_model(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(GlydError, match="not a directory"):
        pack_model(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(UnsupportedModelError, match="no .safetensors"):
        pack_model(tmp_path / "empty", tmp_path / "out")


def test_name_collision_and_empty_tensor_are_refused(tiny, tmp_path):
    src = tmp_path / "two"
    shutil.copytree(tiny, src)
    t = load_file(str(src / "model.safetensors"))
    name = next(iter(t))
    save_file({name: t[name]}, str(src / "extra.safetensors"))
    with pytest.raises(UnsupportedModelError, match="collision"):
        pack_model(src, tmp_path / "out")
    os.remove(src / "extra.safetensors")
    save_file({"model.empty": torch.zeros(0, 4, dtype=torch.bfloat16)}, str(src / "extra.safetensors"))
    with pytest.raises(UnsupportedModelError, match="empty"):
        pack_model(src, tmp_path / "out")


def test_full_disk_leaves_nothing(tiny, tmp_path, monkeypatch):
    import errno

    import glyd_engine.format.checkpoint as ckpt

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._ShardWriter, "flush", lambda self: no_space())
    with pytest.raises(DiskFullError, match="no space"):
        pack_model(tiny, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_existing_destination_is_not_overwritten(tiny, packed):
    with pytest.raises(GlydError, match="not empty"):
        pack_model(tiny, packed)


def test_force_replaces_only_a_glyd_checkpoint(tiny, packed, tmp_path, capsys):
    """`glyd pack SRC DIR --force` on a user's folder is refused and every file in it stays; a file as DST
    is a clear error; a Glyd checkpoint is replaced."""
    from glyd_engine.cli import main

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "config.json").write_text("{}")
    assert main(["pack", str(tiny), str(folder), "--force"]) == 2
    assert "not a Glyd checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    file = tmp_path / "a-file"
    file.write_text("x")
    assert main(["pack", str(tiny), str(file)]) == 2
    assert "is a file" in capsys.readouterr().err and file.read_text() == "x"
    again = tmp_path / "again"
    shutil.copytree(packed, again)
    (again / "stale.txt").write_text("from the old checkpoint")
    assert main(["pack", str(tiny), str(again), "--force"]) == 0
    assert not (again / "stale.txt").exists() and verify_model(again, tiny).compared


def test_stale_temporaries_of_a_dead_writer_are_removed(tmp_path):
    import time

    from glyd_engine.atomic import STALE_AFTER_S, atomic_write_bytes

    target = tmp_path / "file.bin"
    stale = tmp_path / ".file.bin.tmp-dead"
    fresh = tmp_path / ".file.bin.tmp-live"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = time.time() - STALE_AFTER_S - 10
    os.utime(stale, (old, old))
    atomic_write_bytes(target, b"data")
    assert target.read_bytes() == b"data" and not stale.exists() and fresh.exists()


def test_packed_checkpoint_reads_like_any_other_directory(packed):
    """mkdtemp and safetensors make owner-only files; the finished checkpoint gets the umask's permissions."""
    import stat

    from glyd_engine.atomic import _umask

    umask = _umask()
    assert stat.S_IMODE(packed.stat().st_mode) == 0o777 & ~umask
    for f in packed.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name
