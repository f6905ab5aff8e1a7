"""A model directory as Glyd reads it: config.json beside bf16 safetensors files (or a Glyd checkpoint's)."""

from __future__ import annotations

from pathlib import Path

from glyd_engine.errors import GlydError
from glyd_engine.format.safetensors_header import check_safetensors, read_header


def validate_model_dir(path: Path) -> Path:
    """The directory, resolved; fails early, naming what is missing or damaged, rather than deep in a loader."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise GlydError(f"{path} is not a directory; a model is a directory with config.json and "
                        "*.safetensors files")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise GlydError(f"{path} is not a usable model directory: missing {' and '.join(missing)}"
                        " (only safetensors checkpoints are supported)")
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file)
    return path


def model_dtype_report(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype ("BF16", "F32", ...), to reject non-bf16 models up front."""
    report: dict[str, str] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in read_header(file).items():
            report[name] = info["dtype"]
    return report
