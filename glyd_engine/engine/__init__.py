"""The engine runner: vLLM in a child process, driven by JSON-line messages (see protocol.py).

Front ends (glyd-chat, `glyd serve`, the bench) use `EngineClient`; nothing here imports Textual, and
nothing imported by this package's `__init__`, `protocol` or `client` imports torch or vLLM: those load
in the child only.
"""

from glyd_engine.engine.client import EngineClient, EngineLike
from glyd_engine.engine.protocol import (
    Delta,
    EngineSettings,
    Error,
    Event,
    Finished,
    GenerationParams,
    Progress,
    Ready,
    Stats,
    Stopped,
)

__all__ = [
    "Delta",
    "EngineClient",
    "EngineLike",
    "EngineSettings",
    "Error",
    "Event",
    "Finished",
    "GenerationParams",
    "Progress",
    "Ready",
    "Stats",
    "Stopped",
]
