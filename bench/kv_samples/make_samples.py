"""Record post-RoPE K/V of the demo model (SmolLM2-135M-Instruct) for the GPU benchmark.

Writes bench/kv_samples/smollm2_kv.safetensors: K and V of three layers (early, middle, late), the first
1,024 tokens of a held-out text, [T, H=3, D=64] bf16 each (2.4 MB). bench/gpu.py resamples token rows of
these per head and tiles channels to D=128, so the per-channel exponent statistics are the model's.

Run on the CPU:  GLYD_HOME=.cache/test-home .venv/bin/python bench/kv_samples/make_samples.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GLYD_HOME", str(ROOT / ".cache" / "test-home"))

LAYERS = (2, 15, 28)
TOKENS = 1024


def main() -> None:
    from safetensors.torch import save_file

    from glyd_engine.bench.codec import record_kv

    model_dir = Path(os.environ["GLYD_HOME"]) / "cache" / "models" / "SmolLM2-135M-Instruct"
    texts = sorted((ROOT / "assets" / "text" / "heldout").glob("*.txt"))
    text = "\n\n".join(p.read_text() for p in texts)
    keys, vals = record_kv(model_dir, text, TOKENS)
    out = {}
    for layer in LAYERS:
        out[f"k{layer}"] = keys[layer].contiguous()
        out[f"v{layer}"] = vals[layer].contiguous()
    dest = Path(__file__).with_name("smollm2_kv.safetensors")
    save_file(out, str(dest), metadata={"model": "SmolLM2-135M-Instruct", "layers": ",".join(map(str, LAYERS)),
                                       "texts": ",".join(p.name for p in texts)})
    print(f"wrote {dest} ({dest.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
