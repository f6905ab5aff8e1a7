"""Start the engine once from an installed glyd (CI's pipx-style venv) and get one reply from the demo model.

Run by tests/test_installed_engine.py with that venv's Python, so the installed package is the one imported
(it prints where from); GLYD_HOME must hold the built demo model. Exits non-zero unless the engine becomes
ready and answers.
"""

from __future__ import annotations

import queue
import sys
import time

import glyd_engine
from glyd_engine.engine.client import EngineClient
from glyd_engine.engine.protocol import Delta, EngineSettings, Error, Finished, GenerationParams, Ready


def main() -> int:
    print(f"glyd_engine from {glyd_engine.__file__}")
    events: queue.Queue = queue.Queue()
    client = EngineClient(events.put, python=sys.executable)
    start = time.monotonic()
    client.start("demo", EngineSettings(kv="off"))
    text = ""
    try:
        while True:
            event = events.get(timeout=600)
            if isinstance(event, Error):
                print(f"engine failed ({event.kind}): {event.message}", file=sys.stderr)
                return 1
            if isinstance(event, Ready):
                print(f"engine ready in {time.monotonic() - start:.0f} s: {event.engine}")
                client.generate([{"role": "user", "content": "What is the capital of France?"}],
                                GenerationParams(max_tokens=16))
            elif isinstance(event, Delta):
                text += event.text
            elif isinstance(event, Finished):
                print(f"reply: {text!r}")
                return 0 if text.strip() else 1
    finally:
        client.shutdown()


if __name__ == "__main__":
    sys.exit(main())
