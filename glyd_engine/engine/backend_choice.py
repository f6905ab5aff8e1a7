"""Whether the engine child runs the echo stand-in instead of vLLM: one place reads the switch.

`GLYD_ENGINE_BACKEND=echo` (set by the fast tests) swaps vLLM for `echo_backend.EchoBackend` inside the
real child: no model to resolve, no KV tables, no engine to install.
"""

from __future__ import annotations

import os

ENV = "GLYD_ENGINE_BACKEND"


def stand_in_engine() -> bool:
    return os.environ.get(ENV) == "echo"
