"""KV tables: the file is checked and rebuilt when damaged; the build covers the window; the lock holds."""

import math
import threading
from pathlib import Path

import pytest
import torch

from glyd_engine import options
from glyd_engine.errors import CorruptFileError, GlydError, RefusedError, SettingError, UnsupportedModelError
from glyd_engine.format import kv_page
from glyd_engine.progress import Cancelled, CancelToken
from glyd_engine.tables import KVTables, build, ensure_tables, tables_path

ENV_BUILD_DEVICE = options.TABLE_BUILD_DEVICE.env


def test_file_round_trip_and_damage(tmp_path):
    t = KVTables.uniform(3, 2, 64, fingerprint="abc")
    t.tops[3][1, 0, 1, 2] = 9
    t.tops[4][1, 0, 1, 2] = 17
    p = tmp_path / "t.safetensors"
    t.save(p)
    back = KVTables.load(p, "abc")
    assert all(torch.equal(back.tops[b], t.tops[b]) for b in (3, 4)) and back.reserve == t.reserve
    # the 4-bit code's 4-entry reserve would give (3072 + 8 + 8) / 16 = 193 bytes a token, which vLLM pads to a
    # whole bf16 element: the page takes 8 more entries instead, (3072 + 8 + 24) / 16 = 194, and stays dense
    assert back.token_bytes(3) == 182 and back.token_bytes(4) == 194 and back.page_reserve(4) == 12
    with pytest.raises(CorruptFileError, match="another model"):
        KVTables.load(p, "other")
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError):
        KVTables.load(p)
    p.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptFileError):
        KVTables.load(p)


def test_counts_to_tables_picks_the_fullest_window_and_sizes_the_reserve():
    counts = torch.zeros(1, 2, 1, 64, 256, dtype=torch.int64)
    counts[..., 100:110] = torch.arange(10, 0, -1)  # 100 most frequent ... 109 least
    counts[..., 120] = 7  # frequent, but no window holds it with the 8 around 100..107
    tops, floor, reserve = build.counts_to_tables(counts)
    assert int(tops[3][0, 0, 0, 0]) == 107  # 100..107 hold the most
    miss = (2 + 1 + 7) / 62  # 108, 109 and 120 escape
    mean = 16 * 2 * 64 * miss  # entries a tile: 16 tokens, K and V, 64 channels
    assert reserve[3] == kv_page.valid_reserve(math.ceil(mean + math.sqrt(mean)))
    assert int(tops[4][0, 0, 0, 0]) == 115  # any 16 from 100 on hold 100..109; ties go to the highest top
    mean4 = 16 * 2 * 64 * 7 / 62  # only 120 escapes
    assert reserve[4] == kv_page.valid_reserve(math.ceil(mean4 + math.sqrt(mean4)))
    assert 0 < float(floor.min()) < 4


@pytest.mark.slow
def test_build_is_cancellable_and_reused(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GLYD_HOME", str(tmp_path))
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        ensure_tables(demo_model_dir, tokens=512, cancel=token)
    from glyd_engine.models import model_fingerprint

    path = tables_path(model_fingerprint(demo_model_dir))
    assert not path.exists()
    events = []
    t = ensure_tables(demo_model_dir, window=4096, tokens=1024, progress=events.append)
    assert path.exists() and t.window == 4096 and t.tokens == 1024
    assert t.tops[3].shape == (30, 2, 3, 64) and 4 <= t.reserve[3] <= 44 and t.token_bytes(3) <= 182  # >= 1.40x
    assert t.token_bytes(4) <= 198
    assert events[-1].fraction == 1.0 and any("window" in e.phase for e in events)
    assert 9.0 < t.floor_bits(0) < 12.0
    # Reused: no progress the second time.
    again = []
    assert torch.equal(ensure_tables(demo_model_dir, window=4096, progress=again.append).tops[3], t.tops[3])
    assert not again
    # Damaged: rebuilt, not trusted.
    path.write_bytes(path.read_bytes()[:100])
    rebuilt = ensure_tables(demo_model_dir, window=4096, tokens=1024)
    assert torch.equal(rebuilt.tops[3], t.tops[3])
    # Two starts at once: one builds, the other waits for the lock and reads its file.
    path.unlink()
    results: list[KVTables] = []
    calls = []
    real = build.build_tables

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(build, "build_tables", counting)
    threads = [threading.Thread(target=lambda: results.append(
        ensure_tables(demo_model_dir, window=4096, tokens=512))) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and len(results) == 2
    assert torch.equal(results[0].tops[3], results[1].tops[3])
    assert Path(path).exists()


def test_a_build_inside_another_default_device_gives_the_same_tables(demo_model_dir, tmp_path, monkeypatch):
    """`glyd serve`'s first start builds the tables while vLLM constructs the model under `torch.device("cuda")`
    (the engine stopped on "Expected all tensors to be on the same device" on an H100); "meta" stands for it here."""
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "a"))
    plain = ensure_tables(demo_model_dir, window=4096, tokens=512)
    monkeypatch.setenv("GLYD_HOME", str(tmp_path / "b"))
    with torch.device("meta"):
        inside = ensure_tables(demo_model_dir, window=4096, tokens=512)
    for bits in (3, 4):
        assert inside.tops[bits].device.type == "cpu" and torch.equal(inside.tops[bits], plain.tops[bits])
    assert inside.reserve == plain.reserve


def test_tables_of_an_older_version_or_not_this_page_code_are_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    t = KVTables.uniform(2, 1, 64, fingerprint="abc")
    p = tmp_path / "t.safetensors"
    t.save(p)
    with safe_open(str(p), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(p))
    save_file(tensors, str(p), metadata=dict(meta, tables_version="2"))
    with pytest.raises(CorruptFileError, match="version-2 KV tables for an older page code.*rebuild"):
        KVTables.load(p)
    # tops outside 8..254 (windows holding exponent 0 or 255), checksum intact: refused by content
    t.tops[3][0, 0, 0, 0] = 3
    t.save(p)
    with pytest.raises(CorruptFileError, match="8..254"):
        KVTables.load(p)
    # a head size the page code does not hold
    with pytest.raises(UnsupportedModelError, match="head size 80"):
        KVTables.uniform(1, 1, 80)


def test_build_device_follows_the_setting_and_says_what_is_wrong(demo_model_dir, monkeypatch):
    monkeypatch.setenv(ENV_BUILD_DEVICE, " CPU ")
    assert build.build_device(demo_model_dir).type == "cpu"
    monkeypatch.setenv(ENV_BUILD_DEVICE, "gpu0")
    with pytest.raises(SettingError, match="use one of auto, cpu, cuda"):
        build.build_device(demo_model_dir)
    monkeypatch.delenv(ENV_BUILD_DEVICE)
    if not torch.cuda.is_available():
        assert build.build_device(demo_model_dir).type == "cpu"
        monkeypatch.setenv(ENV_BUILD_DEVICE, "cuda")
        with pytest.raises(RefusedError, match="no CUDA GPU.*build the KV tables on the CPU"):
            build.build_device(demo_model_dir)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_build_on_the_gpu_agrees_with_the_cpu_build(demo_model_dir, monkeypatch):
    """The GPU build (bf16) and the CPU build (float32) give tables of the same compression: the same escape-list
    reserve within a page's rounding, and the 3-bit code's tops but for channels at rounding edges. The 4-bit code's
    16-exponent window holds every exponent of most channels from several tops, ties go to the highest, and one value
    more or less at a channel's edge moves it: its tops differ in most channels (22% equal on an H100) at the same
    cost. The tables decide the compression ratio only, never exactness."""
    assert build.build_device(demo_model_dir).type == "cuda"
    gpu = build.build_tables(demo_model_dir, window=4096, tokens=2048)
    monkeypatch.setenv(ENV_BUILD_DEVICE, "cpu")
    cpu = build.build_tables(demo_model_dir, window=4096, tokens=2048)
    same = float((gpu.tops[3] == cpu.tops[3]).float().mean())
    assert same > 0.9, same
    for bits in kv_page.CODE_BITS:
        assert abs(gpu.token_bytes(bits) - cpu.token_bytes(bits)) <= 8, (bits, gpu.describe(), cpu.describe())


@pytest.mark.slow
def test_a_build_in_a_child_process_relays_progress_and_gives_the_same_tables(demo_model_dir, tmp_path, monkeypatch):
    """What glyd-chat's engine does on a GPU machine (no CUDA context before vLLM), run here on the CPU."""
    from glyd_engine.format.fingerprint import model_fingerprint
    from glyd_engine.tables import isolated

    monkeypatch.setenv(ENV_BUILD_DEVICE, "cpu")
    fingerprint = model_fingerprint(demo_model_dir)
    events = []
    child = isolated.build_in_child(demo_model_dir, fingerprint, 1024, 512, events.append)
    here = build.build_tables(demo_model_dir, 1024, 512)
    assert all(torch.equal(child.tops[b], here.tops[b]) for b in kv_page.CODE_BITS) and child.reserve == here.reserve
    assert child.fingerprint == fingerprint and child.window == 1024
    assert [e.job for e in events] == ["kv-tables"] * len(events) and events[-1].done == events[-1].total == 1
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        isolated.build_in_child(demo_model_dir, fingerprint, 1024, 512, cancel=token)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((demo_model_dir / "config.json").read_text())
    with pytest.raises(GlydError, match="failed in its child process"):
        isolated.build_in_child(broken, fingerprint, 1024, 512)
