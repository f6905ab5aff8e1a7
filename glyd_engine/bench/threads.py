"""Decode speed of the demo model in glyd-chat's engine setting (vLLM in-process, eager) by thread count.

`python -m glyd_engine.bench.threads` runs one child per count (OMP_NUM_THREADS=1, then every usable core)
and prints tokens a second for one sequence decoding 128 tokens: what a chat reply sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from glyd_engine import torch_extras

RESULT = "GLYD_RESULT "


def child(model: str) -> dict[str, float]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch_extras.guard()
    import torch
    from vllm import LLM, SamplingParams

    from glyd_engine.engine.engine_args import engine_args
    from glyd_engine.engine.protocol import EngineSettings

    settings = EngineSettings(max_model_len=1024, kv_cache_bytes=256 << 20, enforce_eager=True)
    llm = LLM(**engine_args(model, settings, cpu=True))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    t = time.monotonic()
    llm.generate(["Once upon a time"], params, use_tqdm=False)
    return {"threads": torch.get_num_threads(), "tokens_per_s": round(128 / (time.monotonic() - t), 1)}


def main() -> int:
    if "--child" in sys.argv:
        print(RESULT + json.dumps(child(sys.argv[sys.argv.index("--child") + 1])), flush=True)
        return 0
    from glyd_engine.machine import usable_cores
    from glyd_engine.models import resolve_model

    model = str(resolve_model("demo"))
    rows = []
    for n in sorted({1, usable_cores()}):
        env = {**os.environ, "OMP_NUM_THREADS": str(n)}
        out = subprocess.run([sys.executable, "-m", "glyd_engine.bench.threads", "--child", model],
                             capture_output=True, text=True, env=env, timeout=900).stdout
        rows += [json.loads(line[len(RESULT):]) for line in out.splitlines() if line.startswith(RESULT)]
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
