"""User configuration: `config.toml` (engine settings) and `keymap.toml` (binding id -> keys).

Both live in `paths.config_dir()`; both are optional. A broken file is reported in the app, never a
reason not to start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glyd_engine import paths
from glyd_engine.engine.engine_args import kv_cache_bytes
from glyd_engine.engine.protocol import EngineSettings, parse_setting
from glyd_engine.errors import SettingError


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


ENGINE_KEYS = ("kv", "max_model_len", "kv_cache_mib", "gpu_memory_utilization", "enforce_eager", "dtype",
               "max_num_batched_tokens")  # what config.toml's [engine] takes (kv_cache_mib: the budget in MiB)


def _engine_value(key: str, value: Any, source: str) -> dict[str, Any]:
    """One [engine] entry as EngineSettings fields, parsed (a SettingError naming `source` when it is bad)."""
    if key not in ENGINE_KEYS:
        raise SettingError(f"{source} {key} is not an engine setting", f"use {', '.join(ENGINE_KEYS)}")
    if key == "kv_cache_mib":
        return {"kv_cache_bytes": kv_cache_bytes(parse_setting("kv_cache_bytes", value, source, key))}
    return {key: parse_setting(key, value, source)}


def load_engine_settings(**overrides: Any) -> tuple[EngineSettings, str | None]:
    """Engine settings from `[engine]` in config.toml, then command-line overrides (not None, parsed by argparse).
    Both give the KV budget as `kv_cache_mib`, turned into bytes here (0: vLLM sizes the cache). Each file value is
    parsed here, where it enters: a bad one is reported (naming the file, the key and what it takes) and left out."""
    errors: list[str] = []
    try:
        data = dict(_read_toml(config_path()).get("engine", {}))
    except (OSError, ValueError) as exc:
        data = {}
        errors.append(f"{config_path()}: {exc}")
    values: dict[str, Any] = {}
    for key, value in [*data.items(), *((k, v) for k, v in overrides.items() if v is not None)]:
        source = f"{config_path()} [engine]" if key in data and overrides.get(key) is None else "glyd-chat"
        try:
            values.update(_engine_value(key, value, source))
        except SettingError as exc:
            errors.append(str(exc))
    return EngineSettings(**values), "; ".join(errors) or None


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
