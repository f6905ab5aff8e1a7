"""`glyd pack` / `glyd verify` on real model directories: bit-exact, refusals, corruption named."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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


@pytest.fixture(scope="module")
def sharded(tiny, tmp_path_factory, request) -> Path:
    """The tiny model packed into several shards (a small flush size), as a large model would be."""
    import glyd_engine.format.checkpoint as ckpt

    mp = pytest.MonkeyPatch()
    mp.setattr(ckpt, "SHARD_BYTES", 40_000)
    request.addfinalizer(mp.undo)
    dst = tmp_path_factory.mktemp("sharded") / "tiny-glyd"
    pack_model(tiny, dst)
    mp.undo()
    assert len(list(dst.glob("glyd-*.safetensors"))) >= 3
    return dst


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite_without(shard: Path, drop) -> list[str]:  # noqa: ANN001
    """Save `shard` again without the tensors `drop(name)` selects (metadata kept); the names dropped."""
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        keep = {k: f.get_tensor(k) for k in f.keys() if not drop(k)}  # noqa: SIM118
        gone = [k for k in f.keys() if drop(k)]  # noqa: SIM118
    save_file(keep, str(shard), metadata=meta)
    return gone


def test_verify_without_source_names_a_deleted_shard(sharded, tmp_path):
    ck = _copy(sharded, tmp_path)
    verify_model(ck)
    (ck / "glyd-00002.safetensors").unlink()
    with pytest.raises(CorruptFileError, match="glyd-00002.safetensors"):
        verify_model(ck)


def test_verify_without_source_names_a_tensor_missing_from_its_shard(sharded, tmp_path):
    ck = _copy(sharded, tmp_path)
    shard = next(f for f in sorted(ck.glob("glyd-*.safetensors")) if any("norm" in k for k in read_header(f)))
    gone = _rewrite_without(shard, lambda k: k.endswith("norm.weight"))
    with pytest.raises(CorruptFileError, match=gone[0].replace(".", r"\.")):
        verify_model(ck)


def test_verify_names_a_packed_tensor_whose_parts_are_all_gone(sharded, tmp_path):
    ck = _copy(sharded, tmp_path)
    shard = next(f for f in sorted(ck.glob("glyd-*.safetensors")) if any("_glyd_" in k for k in read_header(f)))
    name = next(k for k in read_header(shard) if k.endswith("_glyd_sm")).removesuffix("_glyd_sm")
    _rewrite_without(shard, lambda k: k.startswith(name + "_glyd_"))
    with pytest.raises(CorruptFileError, match=name):
        verify_model(ck)


def test_verify_checks_each_shard_size(sharded, tmp_path):
    ck = _copy(sharded, tmp_path)
    shard = ck / "glyd-00001.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:  # the same tensors, saved again: a valid file of another size
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, {**f.metadata(), "note": "not ours"}  # noqa: SIM118
    save_file(tensors, str(shard), metadata=meta)
    with pytest.raises(CorruptFileError, match="glyd-00001.safetensors.*bytes"):
        verify_model(ck)


def test_verify_counts_against_config_when_the_index_was_edited_too(sharded, tmp_path):
    """A shard deleted and its entries taken out of the index: config.json still records how many tensors
    the checkpoint holds."""
    ck = _copy(sharded, tmp_path)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "glyd-00002.safetensors"}
    index["metadata"].get("shard_bytes", {}).pop("glyd-00002.safetensors", None)
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    (ck / "glyd-00002.safetensors").unlink()
    with pytest.raises(CorruptFileError, match="config.json records"):
        verify_model(ck)


def test_verify_warns_of_a_shard_the_index_does_not_name(sharded, tmp_path):
    ck = _copy(sharded, tmp_path)
    shutil.copy(ck / "glyd-00001.safetensors", ck / "glyd-00099.safetensors")
    report = verify_model(ck)
    assert report.checked == report.expected
    assert [w for w in report.warnings if "glyd-00099.safetensors" in w]


def test_glyd_verify_command_names_what_is_missing_and_warns_of_strays(sharded, tmp_path, capsys):
    from glyd_engine.cli import main

    ck = _copy(sharded, tmp_path)
    shutil.copy(ck / "glyd-00001.safetensors", ck / "glyd-00099.safetensors")
    capsys.readouterr()
    assert main(["verify", str(ck), "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["tensors_checked"] == report["tensors_expected"] > 0
    assert "exact" not in report  # checksums only: no claim about the source's bits without --against
    assert "glyd: warning: glyd-00099.safetensors is not named by the index" in out.err
    (ck / "glyd-00002.safetensors").unlink()
    assert main(["verify", str(ck)]) == 2
    assert "glyd-00002.safetensors is missing" in capsys.readouterr().err


def test_an_unreadable_file_is_one_line_not_a_traceback(packed, tmp_path, capsys):
    from glyd_engine.cli import main

    ck = _copy(packed, tmp_path)
    (ck / "config.json").unlink()
    (ck / "config.json").mkdir()  # exists, cannot be read as a file: an OSError
    assert main(["verify", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glyd: ") and "config.json" in err and len(err.strip().splitlines()) == 1


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
