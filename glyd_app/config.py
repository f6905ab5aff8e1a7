"""User configuration: `config.toml` (engine settings) and `keymap.toml` (binding id -> keys).

Both live in `paths.config_dir()`; both are optional. A broken file is reported in the app, never a
reason not to start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glyd_engine import paths
from glyd_engine.engine.engine_args import kv_cache_bytes
from glyd_engine.engine.protocol import EngineSettings


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10: TOML config needs 3.11's tomllib
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


def keymap_path() -> Path:
    return paths.config_dir() / "keymap.toml"


def config_path() -> Path:
    return paths.config_dir() / "config.toml"


def load_keymap() -> tuple[dict[str, str], str | None]:
    """({binding id: "key,key"}, an error message or None)."""
    try:
        data = _read_toml(keymap_path())
    except (OSError, ValueError) as exc:
        return {}, f"{keymap_path()}: {exc}"
    section = data.get("keymap", data)
    return {str(k): str(v) for k, v in section.items() if isinstance(v, str)}, None


def load_engine_settings(**overrides: Any) -> tuple[EngineSettings, str | None]:
    """Engine settings from `[engine]` in config.toml, then command-line overrides (not None). Both give
    the KV budget as `kv_cache_mib`, turned into bytes here (0: vLLM sizes the cache)."""
    error = None
    try:
        data = dict(_read_toml(config_path()).get("engine", {}))
    except (OSError, ValueError) as exc:
        data, error = {}, f"{config_path()}: {exc}"
    data.update({k: v for k, v in overrides.items() if v is not None})
    if "kv_cache_mib" in data:
        data["kv_cache_bytes"] = kv_cache_bytes(data.pop("kv_cache_mib"))
    return EngineSettings.from_dict(data), error


def save_engine_setting(key: str, value: str) -> None:
    """Set `key = "value"` in config.toml's [engine] section, keeping every other line (and comment) as the
    user wrote it; written atomically."""
    import re

    from glyd_engine.atomic import atomic_write_bytes

    path = config_path()
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    entry = f'{key} = "{value}"'
    section, start = None, None
    for i, line in enumerate(lines):
        header = re.match(r"\s*\[([^\]]+)\]\s*(#.*)?$", line)
        if header:
            section = header.group(1).strip()
            if section == "engine":
                start = i
            continue
        if section == "engine" and re.match(rf"\s*{re.escape(key)}\s*=", line):
            lines[i] = entry
            break
    else:
        if start is None:
            lines += (["", "[engine]"] if lines else ["[engine]"]) + [entry]
        else:
            lines.insert(start + 1, entry)
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
