"""The Glyd KV-cache mode: its values, their names on screen, and its setting (`SETTING`, parsed by options.py).

Stdlib only: glyd-chat and `glyd serve` parse `--kv` with it before torch or vLLM load, and the vLLM plugin
reads the mode with it in every vLLM process, so the list of modes and the precedence exist once.

Precedence (docs/vllm.md, "Settings"): vLLM's `additional_config {"glyd": {"kv": ...}}` is per engine and
wins; `GLYD_KV` is per process; neither set: auto. Glyd's own front ends (glyd-chat's engine, `glyd serve
--kv`, the benches) all ask the per-engine way: vLLM hands `additional_config` to every process of the
engine and hashes it into its compile-cache key, which an environment variable is not.
"""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

from glyd_engine.options import SECTION, Choice

KVMode = Literal["auto", "lossless", "exact", "off"]
MODES: tuple[KVMode, ...] = get_args(KVMode)
# The modes that hold the cache in Glyd's pages or refuse: auto may keep vLLM's own cache, off always does.
PAGE_MODES: tuple[KVMode, ...] = ("lossless", "exact")
DEFAULT: KVMode = "auto"
# What runs, as the app names it (stats bar, KV mode screen): `Ready.kv_mode` is one of these keys.
RUNNING: dict[str, str] = {"lossless": "Glyd lossless", "exact": "Glyd exact", "off": "vLLM's own cache"}

ENV = "GLYD_KV"  # per process
KEY = "kv"
WHAT = "Glyd KV mode"
SETTING = Choice(KEY, ENV, MODES, WHAT, DEFAULT)


def parse(value: object, source: str | None = ENV) -> KVMode:
    """A KV mode written at `source` (a SettingError naming it and every mode when it is not one)."""
    return cast(KVMode, SETTING.parse(value, source))


def asked(section: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> KVMode:
    """The KV mode asked for an engine (`section`: its additional_config["glyd"]; None: only GLYD_KV)."""
    return cast(KVMode, SETTING.read(section, environ))


def running_name(mode: str) -> str:
    """What runs, in the app's words ("Glyd lossless", "vLLM's own cache")."""
    return RUNNING.get(mode, mode)


def additional_config(mode: str, **more: Any) -> dict[str, Any]:
    """vLLM's `additional_config` asking an engine for `mode` (and other Glyd settings: check, kernels)."""
    return {SECTION: {KEY: parse(mode, KEY), **more}}


def cli_arg(mode: str) -> str:
    """The same for vLLM's command line, in its dotted form: it merges with the user's own dotted
    `--additional-config.*` arguments, where a second JSON `--additional-config` would replace them."""
    return f"--additional-config.{SECTION}.{KEY}={parse(mode, '--kv')}"
