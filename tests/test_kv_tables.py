"""KV tables: the file is checked and rebuilt when damaged; the build covers the window; the lock holds."""

import threading
from pathlib import Path

import pytest
import torch

from glyd_engine.errors import CorruptFileError
from glyd_engine.progress import Cancelled, CancelToken
from glyd_engine.tables import KVTables, build, ensure_tables, tables_path


def test_file_round_trip_and_damage(tmp_path):
    t = KVTables.uniform(3, 2, 16, fingerprint="abc")
    t.decode[1, 0, 1, 2] = torch.tensor([7, 6, 5, 4, 3, 2, 1], dtype=torch.uint8)
    p = tmp_path / "t.safetensors"
    t.save(p)
    back = KVTables.load(p, "abc")
    assert torch.equal(back.decode, t.decode) and back.k_escapes == t.k_escapes
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
    counts = torch.zeros(1, 2, 1, 8, 256, dtype=torch.int64)
    counts[..., 100:110] = torch.arange(10, 0, -1)  # 100 most frequent ... 109 least
    counts[..., 120] = 7  # frequent, but no window holds it with the 7 around 100..106
    decode, floor, reserve = build.counts_to_tables(counts)
    assert decode[0, 0, 0, 0].tolist() == list(range(106, 99, -1))  # code c = 106 - c
    miss = (3 + 2 + 1 + 7) / 62  # the three rarest of 100..109 and 120 escape
    assert reserve == [max(1, int(torch.tensor(8 * miss).ceil()))] * 2
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
    assert t.decode.shape == (30, 2, 3, 64, 7) and t.k_escapes >= 1 and t.v_escapes >= 1
    assert events[-1].fraction == 1.0 and any("window" in e.phase for e in events)
    assert 9.0 < t.floor_bits(0) < 12.0
    # Reused: no progress the second time.
    again = []
    assert torch.equal(ensure_tables(demo_model_dir, window=4096, progress=again.append).decode, t.decode)
    assert not again
    # Damaged: rebuilt, not trusted.
    path.write_bytes(path.read_bytes()[:100])
    rebuilt = ensure_tables(demo_model_dir, window=4096, tokens=1024)
    assert torch.equal(rebuilt.decode, t.decode)
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
    assert torch.equal(results[0].decode, results[1].decode)
    assert Path(path).exists()


def test_tables_of_an_older_version_or_not_windows_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    t = KVTables.uniform(2, 1, 32, fingerprint="abc")
    p = tmp_path / "t.safetensors"
    t.save(p)
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(p))
    old = dict(meta, tables_version="1")
    save_file(tensors, str(p), metadata=old)
    with pytest.raises(CorruptFileError, match="version-1 KV tables.*rebuild"):
        KVTables.load(p)
    # a top-7 table (version 1's kind) under the current version: refused by its content, checksum intact
    t.decode[0, 0, 0, 0] = torch.tensor([126, 125, 127, 124, 123, 122, 121], dtype=torch.uint8)
    t.save(p)
    with pytest.raises(CorruptFileError, match="windows"):
        KVTables.load(p)
