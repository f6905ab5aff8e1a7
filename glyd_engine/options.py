"""Glyd's settings, each declared once: its key in vLLM's `additional_config["glyd"]`, its environment variable,
the values it takes. A value is parsed where it enters (the environment, vLLM's additional_config, a command
line, config.toml) into a typed value; a bad one is one `SettingError` naming where it came from and every value
the setting takes, so the user can fix it without the docs. Everything past the edge takes the typed value.

Stdlib only: glyd-chat, `glyd serve` and `glyd doctor` parse with it before torch or vLLM load. The KV mode's
own declaration is `kv_mode.SETTING`; the plugin reads all of them for an engine through
`vllm_plugin.settings.options`.

Precedence (docs/vllm.md, "Settings"): the engine's `additional_config {"glyd": {KEY: ...}}` wins over the
process's environment variable; neither set: the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from glyd_engine.errors import SettingError

SECTION = "glyd"  # additional_config's key for Glyd's settings (per engine)


@dataclass(frozen=True)
class Choice:
    """A setting that takes one of a few words (case and surrounding spaces ignored)."""

    key: str  # additional_config glyd.<key>
    env: str  # the environment variable
    values: tuple[str, ...]
    what: str  # what a value is, for the error: "Glyd KV mode"
    default: str = "auto"

    def refusal(self, text: str, source: str | None) -> SettingError:
        said = f"{source}={text!r}" if source else repr(text)
        return SettingError(f"{said} is not a {self.what}", f"use one of {', '.join(self.values)}")

    def parse(self, value: object, source: str | None) -> str:
        """`value` as one of `values`; `source` names where it came from in the error (None: the caller's
        framing names it, as argparse does)."""
        text = str(value).strip().lower()
        if text not in self.values:
            raise self.refusal(text, source)
        return text

    def read(self, section: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> str:
        """The value for one engine by the precedence above (`section`: its additional_config["glyd"]; an empty
        environment variable counts as unset). The losing source is not read."""
        value = (section or {}).get(self.key)
        if value is not None:
            return self.parse(value, f"additional_config {SECTION}.{self.key}")
        value = (os.environ if environ is None else environ).get(self.env)
        return self.parse(value, self.env) if value else self.default

    def arg_type(self) -> Callable[[str], str]:
        """An argparse `type=`: a bad `--flag` value gets this setting's error, under argparse's own framing."""

        def parse(text: str) -> str:
            try:
                return self.parse(text, None)
            except SettingError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from exc

        return parse

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.values) + "}"


@dataclass(frozen=True)
class Megabytes(Choice):
    """A size in MB (a number > 0, e.g. 512 or 0.5), or one of `values` (words, e.g. auto)."""

    def refusal(self, text: str, source: str | None) -> SettingError:
        said = f"{source}={text!r}" if source else repr(text)
        return SettingError(f"{said} is not a {self.what}",
                            f"use a number of MB greater than 0 (e.g. 512) or {', '.join(self.values)}")

    def parse(self, value: object, source: str | None) -> str:
        text = str(value).strip().lower()
        if text in self.values:
            return text
        try:
            mb = float(text)
        except ValueError:
            raise self.refusal(text, source) from None
        if not 0 < mb < float("inf"):
            raise self.refusal(text, source)
        return text

    @property
    def metavar(self) -> str:
        return "{MB," + ",".join(self.values) + "}"


ON = ("on", "true", "yes", "1")
OFF = ("off", "false", "no", "0")

# What runs the KV pages: torch (the CPU build: pages decoded, then vLLM's own CPU kernel), cuda (the GPU backend:
# the CUDA kernels in kernels/cuda read compressed pages), or reference (the GPU backend's wiring on the torch
# reference of those kernels: how the tests run it on the CPU build). auto: by platform.
KERNELS = Choice("kernels", "GLYD_KV_KERNELS", ("auto", "torch", "cuda", "reference"), "Glyd kernel choice")
# The page code's width: 3 bits (the most tokens: ~11.3 bits a value) or 4 (~12.1 bits, about a tenth of the
# escapes, which decode attention pays for). auto: 3 on the CPU build, 4 where the CUDA kernels run (docs/gpu.md).
CODE = Choice("code", "GLYD_KV_CODE", ("auto", "3", "4"), "Glyd KV code width")
# Debug: keep a bf16 shadow of every page and compare each value read.
CHECK = Choice("check", "GLYD_KV_CHECK", ON + OFF, "Glyd KV check switch", default="off")
# What a Glyd checkpoint's matmuls compute: lossless (auto; the weights decoded inside the CUDA matmul for small
# batches: every weight exact, the products summed in the kernel's order) or exact (each weight decoded to bf16 and
# multiplied by the bf16 model's own GEMM: its outputs bit for bit, slower). On the CPU build both are exact.
WEIGHTS = Choice("weights", "GLYD_WEIGHTS", ("auto", "lossless", "exact"), "Glyd weights mode")
# How `--quantization glyd` holds a weight in memory: resident (row-major) or fragment (the CUDA matmul's layout,
# docs/format.md section 4.1). auto: fragment on CUDA where the weight's shape allows it and the CUDA matmul builds.
WEIGHT_LAYOUT = Choice("weight_layout", "GLYD_WEIGHT_LAYOUT", ("auto", "resident", "fragment"), "Glyd weight layout")

# The most memory one layer's overflow arena may hold (escapes past their tile's list; kernels/kv_overflow.py). auto:
# as much as the device has. A request whose values would pass it is refused with an error, never stored in part.
ARENA_MB = Megabytes("arena_mb", "GLYD_KV_ARENA_MB", ("auto",), "Glyd overflow arena limit (MB a layer)")

# besides the KV mode (kv_mode.SETTING)
PLUGIN: tuple[Choice, ...] = (KERNELS, CODE, CHECK, WEIGHTS, WEIGHT_LAYOUT, ARENA_MB)
# Per process, not per engine (a model's tables are built once, before any engine sizes its cache): where the KV table
# build runs. auto: a CUDA GPU whose free memory holds the bf16 weights, else the CPU (tables/build.py).
TABLE_BUILD_DEVICE = Choice("build_device", "GLYD_KV_BUILD_DEVICE", ("auto", "cpu", "cuda"),
                            "Glyd KV table build device")


def is_on(value: str) -> bool:
    """A parsed on/off word as a bool."""
    return value in ON
