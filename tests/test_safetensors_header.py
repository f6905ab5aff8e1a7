"""The one safetensors header reader: damage is a CorruptFileError naming the file, wherever it is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glyd_engine.engine.report import weights_report
from glyd_engine.errors import CorruptFileError
from glyd_engine.format.safetensors_header import (
    DTYPES,
    check_safetensors,
    read_header,
    read_safetensors_header,
)


def _file(path: Path) -> Path:
    save_file({"w": torch.ones(4, 8, dtype=torch.bfloat16), "n": torch.ones(8, dtype=torch.float32)}, str(path),
              metadata={"format": "pt"})
    return path


def test_entries_without_metadata_and_the_data_offset(tmp_path: Path) -> None:
    path = _file(tmp_path / "model.safetensors")
    header, data_start = read_safetensors_header(path)
    assert "__metadata__" in header and data_start == 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    entries = read_header(path)
    assert set(entries) == {"w", "n"} and entries["w"]["dtype"] == "BF16" and entries["w"]["shape"] == [4, 8]
    check_safetensors(path)  # a sound file passes


def test_the_dtype_table_matches_torch() -> None:
    for name, dtype in DTYPES.items():
        assert getattr(torch, dtype.torch_name).itemsize == dtype.item_bytes, name


@pytest.mark.parametrize(("raw", "needle"), [
    (b"\x01\x00", "too short"),
    (struct.pack("<Q", 2**40) + b"{}", "implausible"),
    (struct.pack("<Q", 16) + b"{not json", "damaged safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "truncated"),
])
def test_a_damaged_header_names_the_file(tmp_path: Path, raw: bytes, needle: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CorruptFileError, match=needle) as err:
        read_header(path)
    assert str(path) in str(err.value)


def test_offsets_past_the_end_are_damage(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1 << 40], "data_offsets": [0, 1 << 41]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    read_header(path)  # the header itself parses
    with pytest.raises(CorruptFileError, match=r"model.safetensors is damaged: w claims bytes"):
        check_safetensors(path)


def test_the_engine_report_reads_through_it(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    _file(model / "model.safetensors")
    report = weights_report(model)
    assert (report.bytes, report.bf16_bytes, report.dtype, report.file_bytes) == (80, 80, "bfloat16", 96)
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CorruptFileError, match="model.safetensors"):
        weights_report(model)
