"""The Glyd KV-cache mode: its values, how a written value is read, and which of its two settings wins.

Stdlib only: glyd-chat and `glyd serve` parse `--kv` with it before torch or vLLM load, and the vLLM plugin
reads the mode with it in every vLLM process, so the list of modes and the precedence exist once.

Precedence (docs/vllm.md, "Settings"): vLLM's `additional_config {"glyd": {"kv": ...}}` is per engine and
wins; `GLYD_KV` is per process; neither set: auto. Glyd's own front ends (glyd-chat's engine, `glyd serve
--kv`, the benches) all ask the per-engine way: vLLM hands `additional_config` to every process of the
engine and hashes it into its compile-cache key, which an environment variable is not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, cast, get_args

KVMode = Literal["auto", "lossless", "exact", "off"]
MODES: tuple[KVMode, ...] = get_args(KVMode)
# The modes that hold the cache in Glyd's pages or refuse: auto may keep vLLM's own cache, off always does.
PAGE_MODES: tuple[KVMode, ...] = ("lossless", "exact")
DEFAULT: KVMode = "auto"

ENV = "GLYD_KV"  # per process
SECTION = "glyd"  # additional_config's key for Glyd's settings (per engine)
KEY = "kv"
WHAT = "Glyd KV mode"


def parse_choice(value: object, source: str, choices: tuple[str, ...], what: str) -> str:
    """`value` as one of `choices` (case and surrounding spaces ignored); a bad value names where it came
    from and every choice, so the user can fix it without the docs."""
    text = str(value).strip().lower()
    if text not in choices:
        raise ValueError(f"{source}={text!r} is not a {what}; use one of {', '.join(choices)}")
    return text


def parse(value: object, source: str = ENV) -> KVMode:
    return cast(KVMode, parse_choice(value, source, MODES, WHAT))


def choose(section: Mapping[str, Any], key: str, env: str, choices: tuple[str, ...], what: str,
           environ: Mapping[str, str] | None = None) -> str:
    """One Glyd setting by the precedence above: `section[key]` (the engine's additional_config["glyd"])
    wins over the environment variable `env`; neither set: auto. Every plugin setting shares it."""
    value, source = section.get(key), f"additional_config {SECTION}.{key}"
    if value is None:
        value, source = (os.environ if environ is None else environ).get(env) or DEFAULT, env
    return parse_choice(value, source, choices, what)


def asked(section: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> KVMode:
    """The KV mode asked for an engine (`section`: its additional_config["glyd"]; None: only GLYD_KV)."""
    return cast(KVMode, choose(section or {}, KEY, ENV, MODES, WHAT, environ))


def additional_config(mode: str, **more: Any) -> dict[str, Any]:
    """vLLM's `additional_config` asking an engine for `mode` (and other Glyd settings: check, kernels)."""
    return {SECTION: {KEY: parse(mode, KEY), **more}}


def cli_arg(mode: str) -> str:
    """The same for vLLM's command line, in its dotted form: it merges with the user's own dotted
    `--additional-config.*` arguments, where a second JSON `--additional-config` would replace them."""
    return f"--additional-config.{SECTION}.{KEY}={parse(mode, '--kv')}"
