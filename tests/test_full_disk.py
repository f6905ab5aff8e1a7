"""A full disk, for real (no mocked writer): `glyd pack` and the KV tables write run out of space on a small
tmpfs, and again under RLIMIT_FSIZE in a child (where mounting is not allowed, that case alone still runs).
The user gets one clear line and a non-zero exit code, and the destination is left as it was."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

SMALL = 64 * 1024  # bytes: neither the tiny model's checkpoint (~150 KB) nor KV tables for 32 layers x 8 heads fit


@dataclass
class SmallDisk:
    root: Path
    fsize: int | None  # RLIMIT_FSIZE for the child, where root is not a small tmpfs

    def run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        """`python ARGS` in a child that runs out of space under `root`."""

        def limit() -> None:
            if self.fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (self.fsize, self.fsize))

        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env,
                              preexec_fn=limit)


@pytest.fixture(params=["tmpfs", "fsize"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SmallDisk]:
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "fsize":
        yield SmallDisk(root, SMALL)
        return
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(root)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()}); the RLIMIT_FSIZE case covers it")
    try:
        yield SmallDisk(root, None)
    finally:
        subprocess.run(["umount", str(root)], check=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def _one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("glyd:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_pack_onto_a_full_disk_is_one_clear_line_and_leaves_nothing(small_disk: SmallDisk, tiny: Path) -> None:
    before = _tree(small_disk.root)
    r = small_disk.run(["-m", "glyd_engine.cli", "pack", str(tiny), str(small_disk.root / "out")])
    assert r.returncode != 0
    line = _one_clear_line(r.stderr)
    assert "out" in line and ("no space left" in line or "larger than" in line), line
    assert _tree(small_disk.root) == before  # no checkpoint, no temporary directory


def test_pack_force_onto_a_full_disk_keeps_the_old_destination(small_disk: SmallDisk, tiny: Path) -> None:
    old = small_disk.root / "out"
    old.mkdir()
    # an earlier Glyd checkpoint (the only kind --force replaces)
    (old / "config.json").write_text('{"quantization_config": {"quant_method": "glyd"}, "an": "earlier checkpoint"}')
    before = _tree(small_disk.root)
    r = small_disk.run(["-m", "glyd_engine.cli", "pack", str(tiny), str(old), "--force"])
    assert r.returncode != 0
    assert "left as it was" in _one_clear_line(r.stderr)
    assert _tree(small_disk.root) == before


def test_kv_tables_write_onto_a_full_disk_raises_disk_full(small_disk: SmallDisk) -> None:
    code = ("import sys; from pathlib import Path; from glyd_engine.atomic import DiskFullError; "
            "from glyd_engine.tables.kv_tables import KVTables\n"
            "try:\n    KVTables.uniform(32, 8, 128).save(Path(sys.argv[1]))\n"
            "except DiskFullError as exc:\n    print('DiskFullError:', exc)\n")
    r = small_disk.run(["-c", code, str(small_disk.root / "kv" / "tables.safetensors")])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DiskFullError:") and "tables.safetensors" in r.stdout, r.stdout + r.stderr
    assert not [p for p in small_disk.root.rglob("*") if p.is_file()]
