"""Child process for the refusal tests: build vLLM engine configs (no engine start), report what Glyd
decided for each case (`--without NAME`: with the hook AttentionBackend.NAME removed first). Prints
`GLYD_CASE name` before each case (vLLM's log lines of that case follow on stdout) and one JSON line at the
end: {case: {"ok": bool, "error": str}}."""

from __future__ import annotations

import json
import sys


def main() -> int:
    cases = json.loads(sys.argv[1])
    if len(sys.argv) > 2:  # "--without NAME": a vLLM that lacks the hook AttentionBackend.NAME
        from vllm.v1.attention.backend import AttentionBackend

        delattr(AttentionBackend, sys.argv[sys.argv.index("--without") + 1])
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from glyd_engine.vllm_plugin import settings

    out = {}
    for name, case in cases.items():
        settings._logged.clear()
        print(f"GLYD_CASE {name}", flush=True)
        args = {"enforce_eager": True, "skip_tokenizer_init": True, **case}
        try:
            cfg = EngineArgs(**args).create_engine_config()
            out[name] = {"ok": True, "error": "", "quantization": cfg.model_config.quantization}
        except Exception as exc:  # vLLM wraps config errors in pydantic's ValidationError
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.flush()
    print("GLYD_RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
