"""The issue's acceptance path on the real demo model, through the `glyd` command line."""

import json
import shutil

import pytest

from glyd_engine.cli import main
from glyd_engine.format.checkpoint import read_header


@pytest.mark.slow
def test_pack_verify_and_a_flipped_byte_on_the_demo_model(demo_model_dir, packed_demo_dir, tmp_path, capsys):
    dst = tmp_path / "demo-glyd"
    shutil.copytree(packed_demo_dir, dst)  # packed by `glyd pack` (the fixture); damaged below
    capsys.readouterr()
    assert main(["verify", str(dst), "--against", str(demo_model_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors_compared_bit_for_bit"] == report["tensors_checked"] == report["tensors_expected"] == 272
    assert report["exact"] is True and report["warnings"] == []
    assert report["weights_bits_per_value"] <= 10.9
    # One flipped byte in the middle of a packed tensor's data: verify fails and names the tensor.
    f = next(dst.glob("glyd-*.safetensors"))
    header = read_header(f)
    name = "model.layers.7.mlp.down_proj.weight"
    start, end = header[name + "_glyd_exp"]["data_offsets"]
    with open(f, "rb") as fh:
        data_at = 8 + int.from_bytes(fh.read(8), "little")
    raw = bytearray(f.read_bytes())
    raw[data_at + (start + end) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    assert main(["verify", str(dst)]) == 2
    assert name in capsys.readouterr().err


def test_verify_of_a_missing_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "glyd:" in capsys.readouterr().err
