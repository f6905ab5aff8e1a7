"""The Glyd checkpoint: a bf16 safetensors model directory with its large tensors packed.

`pack_model` streams tensor by tensor (peak memory: the output buffer plus a few bytes a value of the
tensor in hand) into a temporary directory renamed into place only when complete. Plain tensors keep
their bytes and get a crc32 in their file's metadata, so `verify_model` checks every byte it can. The index
records each shard's size and config.json how many tensors there are and a hash of their names, so a
shard or a tensor that goes missing is named by `verify_model` even without the source.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from glyd_engine.atomic import atomic_dir
from glyd_engine.errors import CorruptFileError, GlydError, MismatchError, UnsupportedModelError
from glyd_engine.format import FORMAT_VERSION, weights
from glyd_engine.format.fingerprint import model_fingerprint
from glyd_engine.format.safetensors_header import DTYPES, FLOATS, read_header
from glyd_engine.progress import CancelToken, PhaseTimer, ProgressCallback, no_progress

MIN_PACKED_VALUES = 4096  # smaller tensors (norms, biases) stay plain: their tables would cost more
SHARD_BYTES = 1 << 30  # an output file is flushed past this many bytes
INDEX = "model.safetensors.index.json"
SHARD_BYTES_KEY = "shard_bytes"  # index metadata: file name -> its size in bytes
PLAIN_CRC_KEY = "glyd_plain_crc32"
QUANT_METHOD = "glyd"


def source_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise GlydError(f"{model_dir} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json: not a model directory")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no .safetensors files (Glyd reads safetensors only)")
    return files


def is_packable(dtype: str, shape: list[int]) -> bool:
    return dtype == "BF16" and len(shape) >= 2 and int(np.prod(shape)) >= MIN_PACKED_VALUES


def check_source(model_dir: Path) -> dict[str, tuple[Path, dict]]:
    """Every tensor of a source model, refusing what Glyd cannot pack losslessly."""
    tensors: dict[str, tuple[Path, dict]] = {}
    files = source_files(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD:
        raise UnsupportedModelError(f"{model_dir} is already a Glyd checkpoint")
    for path in files:
        for name, info in read_header(path).items():
            if name in tensors:
                raise UnsupportedModelError(f"tensor name collision: {name} is in both {tensors[name][0].name} "
                                            f"and {path.name}")
            if weights.split_part_name(name):
                raise UnsupportedModelError(f"tensor {name} in {path.name} uses Glyd's reserved suffix "
                                            f"'{weights.SUFFIX}'; rename it before packing")
            dtype, shape = info["dtype"], info["shape"]
            if dtype in FLOATS - {"BF16"} and len(shape) >= 2:
                raise UnsupportedModelError(
                    f"{name} is {dtype}: Glyd packs bf16 models only (fp32/fp16 cannot become bf16 without "
                    "rounding, so it would not be lossless). Use the model's bf16 release.")
            if int(np.prod(shape)) == 0:
                raise UnsupportedModelError(f"{name} in {path.name} is empty (shape {shape}); Glyd refuses "
                                            "empty tensors")
            tensors[name] = (path, info)
    return tensors


def _plain_crc(t: torch.Tensor) -> int:
    raw = t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return zlib.crc32(raw.numpy().data) & 0xFFFFFFFF


@dataclass
class PackReport:
    packed_values: int = 0
    packed_bytes: int = 0
    plain_bytes: int = 0
    tensors: list[tuple[str, tuple[int, ...], float]] = field(default_factory=list)  # name, shape, bits

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.packed_bytes / max(1, self.packed_values)

    @property
    def total_bytes(self) -> int:
        return self.packed_bytes + self.plain_bytes


class _ShardWriter:
    def __init__(self, out: Path) -> None:
        self.out, self.buf, self.crcs, self.size, self.count = out, {}, {}, 0, 0
        self.weight_map: dict[str, str] = {}
        self.shard_bytes: dict[str, int] = {}

    def add(self, tensors: dict[str, torch.Tensor], plain_crc: dict[str, int] | None = None) -> None:
        for k, t in tensors.items():
            self.buf[k] = t
            self.size += t.numel() * t.element_size()
        self.crcs.update(plain_crc or {})
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        self.count += 1
        name = f"glyd-{self.count:05d}.safetensors"
        meta = {"format": "glyd", "format_version": str(FORMAT_VERSION), PLAIN_CRC_KEY: json.dumps(self.crcs)}
        save_file({k: v.contiguous() for k, v in self.buf.items()}, str(self.out / name), metadata=meta)
        self.shard_bytes[name] = (self.out / name).stat().st_size
        for k in self.buf:
            self.weight_map[k] = name
        self.buf, self.crcs, self.size = {}, {}, 0


def check_destination(dst: Path, overwrite: bool) -> None:
    """Refuse a destination whose files pack would lose: `overwrite` replaces only a Glyd checkpoint."""
    if dst.exists() and not dst.is_dir():
        raise GlydError(f"{dst} is a file; the checkpoint is a directory: choose a path that does not exist")
    if not dst.exists() or not any(dst.iterdir()):
        return
    if not overwrite:
        raise GlydError(f"{dst} exists and is not empty; choose another path, or pass --force to replace the Glyd "
                        "checkpoint there")
    if not is_glyd_checkpoint(dst):
        raise GlydError(f"{dst} is not a Glyd checkpoint (its config.json does not say quant_method \"glyd\"): "
                        "--force replaces only a Glyd checkpoint, never other files; nothing was changed. "
                        "Choose another path")


def _source_bytes(info: dict) -> int:
    """A source tensor's bytes, from its header entry (the progress total)."""
    dtype = DTYPES.get(info["dtype"])
    return int(np.prod(info["shape"])) * (dtype.item_bytes if dtype else 2)


def pack_model(src: Path, dst: Path, progress: ProgressCallback = no_progress,
               cancel: CancelToken | None = None, overwrite: bool = False) -> PackReport:
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise GlydError("the destination must differ from the source")
    check_destination(dst, overwrite)
    tensors = check_source(src)
    total = sum(_source_bytes(info) for _, info in tensors.values())
    report = PackReport()
    with atomic_dir(dst) as tmp:
        timer = PhaseTimer("pack", f"packing {src.name}", total, progress, cancel)
        writer = _ShardWriter(tmp)
        done = 0
        for path in source_files(src):
            with safe_open(str(path), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    t = f.get_tensor(name)
                    info = tensors[name][1]
                    if is_packable(info["dtype"], info["shape"]):
                        p = weights.encode(t, name)
                        writer.add(p.parts(name))
                        report.packed_values += p.numel
                        report.packed_bytes += p.nbytes
                        report.tensors.append((name, p.shape, p.bits_per_value))
                    else:
                        writer.add({name: t}, {name: _plain_crc(t)})
                        report.plain_bytes += t.numel() * t.element_size()
                    done += t.numel() * t.element_size()
                    timer.update(done, f"packing {name}")
        writer.flush()
        index_meta = {"format": "glyd", SHARD_BYTES_KEY: writer.shard_bytes}
        (tmp / INDEX).write_text(json.dumps({"metadata": index_meta, "weight_map": writer.weight_map}, indent=1))
        config = json.loads((src / "config.json").read_text())
        # The same values as the source: per-model caches (the KV tables) are shared through its fingerprint.
        config["quantization_config"] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                                         "chunk": weights.CHUNK, "min_packed_values": MIN_PACKED_VALUES,
                                         "source_fingerprint": model_fingerprint(src),
                                         "tensors": len(tensors), "tensor_names_sha256": names_digest(tensors)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for extra in sorted(src.iterdir()):
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX):
                shutil.copy2(extra, tmp / extra.name)
    return report


def names_digest(names: object) -> str:
    """sha256 of the sorted logical tensor names (what config.json records, so a lost tensor is noticed)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()  # type: ignore[call-overload]


def _logical(key: str) -> str:
    split = weights.split_part_name(key)
    return split[0] if split else key


@dataclass
class Layout:
    """What a checkpoint's index and config.json say it holds, checked against the files present."""

    files: list[Path]  # the shards the index names, in order
    expected: set[str]  # logical tensor names the index names
    warnings: list[str]


def check_layout(model_dir: Path, config: dict) -> Layout:
    """Every shard the index names exists, has its recorded size and holds exactly the tensors the index puts
    in it; the index's tensors are those config.json counts. Raises CorruptFileError naming what is missing;
    a shard the index does not name (vLLM does not load it) is a warning."""
    model_dir = Path(model_dir)
    try:
        index = json.loads((model_dir / INDEX).read_text())
        weight_map: dict[str, str] = dict(index["weight_map"])
    except FileNotFoundError as exc:
        raise CorruptFileError(f"{model_dir} has no {INDEX}: it lists the checkpoint's tensors (re-pack it)") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{model_dir / INDEX} is damaged ({exc})") from exc
    sizes = (index.get("metadata") or {}).get(SHARD_BYTES_KEY)
    warnings: list[str] = []
    if not isinstance(sizes, dict):
        sizes = {}
        warnings.append(f"{INDEX} records no shard sizes (written by an earlier glyd): sizes not checked")
    by_file: dict[str, set[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, set()).add(key)
    files: list[Path] = []
    for file in sorted(by_file):
        path = model_dir / file
        if not path.is_file():
            lost = sorted({_logical(k) for k in by_file[file]})
            raise CorruptFileError(f"{file} is missing from {model_dir}: the index puts {len(lost)} tensor(s) "
                                   f"there ({_some(lost)})")
        held = set(read_header(path))
        if by_file[file] - held:
            raise CorruptFileError(f"{file} lacks {_some(sorted(by_file[file] - held))}, which the index puts there")
        if held - by_file[file]:
            raise CorruptFileError(f"{file} holds {_some(sorted(held - by_file[file]))}, which the index does not "
                                   "name there")
        if file in sizes and path.stat().st_size != int(sizes[file]):
            raise CorruptFileError(f"{file} is {path.stat().st_size} bytes; the index records {sizes[file]} bytes "
                                   "(truncated, extended or replaced)")
        files.append(path)
    for path in sorted(model_dir.glob("*.safetensors")):
        if path.name not in by_file:
            warnings.append(f"{path.name} is not named by the index: vLLM does not load it and verify did not "
                            "read it (a stray file?)")
    expected = {_logical(k) for k in weight_map}
    qc = config.get("quantization_config") or {}
    if "tensors" in qc and (int(qc["tensors"]) != len(expected)
                            or qc.get("tensor_names_sha256", names_digest(expected)) != names_digest(expected)):
        raise CorruptFileError(f"the index names {len(expected)} tensors; config.json records {qc['tensors']} "
                               "(and a hash of their names) at packing: tensors were lost with their index entries")
    if "tensors" not in qc:
        warnings.append("config.json records no tensor count (packed by an earlier glyd): the index alone "
                        "says what should be there")
    if not files:
        raise CorruptFileError(f"{model_dir}/{INDEX} names no shard: not a Glyd checkpoint")
    return Layout(files, expected, warnings)


def _some(names: list[str], n: int = 10) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _iter_checkpoint(model_dir: Path, files: list[Path] | None = None) -> Iterator[tuple[str, str, object]]:
    """Yield (kind, name, payload) per logical tensor: ('packed', X, PackedTensor) or ('plain', X, (t, crc)).
    `files`: the shards to read (default: those the index names, or every glyd-*.safetensors without one)."""
    from safetensors import safe_open

    if files is None:
        if (Path(model_dir) / INDEX).exists():
            files = check_layout(model_dir, {}).files
        else:
            files = sorted(Path(model_dir).glob("glyd-*.safetensors"))
    if not files:
        raise CorruptFileError(f"{model_dir} has no glyd-*.safetensors files: not a Glyd checkpoint")
    seen: set[str] = set()
    for path in files:
        read_header(path)
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                crcs = json.loads(meta.get(PLAIN_CRC_KEY, "{}"))
                groups: dict[str, dict[str, torch.Tensor]] = {}
                for key in f.keys():  # noqa: SIM118
                    split = weights.split_part_name(key)
                    if split:
                        groups.setdefault(split[0], {})[key] = f.get_tensor(key)
                    else:
                        if key not in crcs:
                            raise CorruptFileError(f"{path.name}: plain tensor {key} has no checksum")
                        seen.add(key)
                        yield "plain", key, (f.get_tensor(key), int(crcs[key]))
        except (CorruptFileError, MismatchError):
            raise
        except Exception as exc:
            raise CorruptFileError(f"{path} is damaged ({exc})") from exc
        for name, parts in groups.items():
            seen.add(name)
            yield "packed", name, weights.PackedTensor.from_parts(name, parts)


def _decoded(kind: str, name: str, payload: object) -> torch.Tensor:
    """One logical tensor of a checkpoint, decoded and checked against its checksum."""
    if kind == "packed":
        try:
            return weights.decode(payload, name)  # type: ignore[arg-type]
        except ValueError as exc:
            raise CorruptFileError(f"{name}: cannot be decoded ({exc})") from exc
    t, crc = payload  # type: ignore[misc]
    if _plain_crc(t) != crc:
        raise CorruptFileError(f"{name}: stored bytes do not match their checksum (the file is damaged)")
    return t


def decoded_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Glyd checkpoint as the source model held it (for tools that need plain weights)."""
    for kind, name, payload in _iter_checkpoint(model_dir):
        yield name, _decoded(kind, name, payload)


def is_glyd_checkpoint(model_dir: Path) -> bool:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


@dataclass
class VerifyReport(PackReport):
    checked: int = 0  # tensors decoded and checked (checksums)
    compared: int = 0  # tensors compared bit for bit with the source (--against)
    expected: int = 0  # tensors the index names (and config.json counts)
    warnings: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every tensor the index names was decoded and compared bit for bit with the source."""
        return self.expected > 0 and self.compared == self.checked == self.expected


def verify_model(model_dir: Path, against: Path | None = None, progress: ProgressCallback = no_progress
                 ) -> VerifyReport:
    """Decode every tensor and check it (checksums; with `against`, every bit). Raises naming the tensor."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise CorruptFileError(f"{model_dir}/config.json does not declare quant_method 'glyd'")
    if int(qc.get("format_version", -1)) != FORMAT_VERSION:
        raise CorruptFileError(f"{model_dir} is format version {qc.get('format_version')}; this Glyd reads "
                               f"version {FORMAT_VERSION}")
    layout = check_layout(model_dir, config)
    source = check_source(against) if against is not None else None
    report = VerifyReport(expected=len(layout.expected), warnings=list(layout.warnings))
    timer = PhaseTimer("verify", f"verifying {model_dir.name}", report.expected, progress)
    names: set[str] = set()
    for kind, name, payload in _iter_checkpoint(model_dir, layout.files):
        t = _decoded(kind, name, payload)
        if kind == "packed":
            p = payload
            report.packed_values += p.numel
            report.packed_bytes += p.nbytes
            report.tensors.append((name, p.shape, p.bits_per_value))
        else:
            report.plain_bytes += t.numel() * t.element_size()
        report.checked += 1
        names.add(name)
        if source is not None:
            if name not in source:
                raise MismatchError(f"{name} is in the checkpoint but not in {against}")
            path, _ = source[name]
            with safe_open(str(path), "pt") as f:
                ref = f.get_tensor(name)
            if ref.dtype != t.dtype or tuple(ref.shape) != tuple(t.shape):
                raise MismatchError(f"{name}: {t.dtype} {tuple(t.shape)} here, {ref.dtype} {tuple(ref.shape)} "
                                    "in the source")
            a, b = t.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
            if not torch.equal(a, b):
                n_diff = int((a != b).sum())
                raise MismatchError(f"{name}: {n_diff} bytes differ from the source")
            report.compared += 1
        timer.update(report.checked, f"verified {name}")
    if names != layout.expected:  # check_layout matched every shard's header to the index: a bug if reached
        raise CorruptFileError(f"decoded tensors differ from the index: {_some(sorted(names ^ layout.expected))}")
    if source is not None:
        missing = sorted(set(source) - names)
        if missing:
            raise MismatchError(f"missing from the checkpoint: {_some(missing)}")
    return report
