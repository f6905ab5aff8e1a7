"""The table build in a child process, for a process that has not touched CUDA and will start vLLM next (glyd-chat's
engine): a GPU build there would leave a CUDA context behind (about half a GB beside vLLM's budget) and make vLLM
start its engine core by spawn instead of fork. The child builds (on the GPU or the CPU, `build.build_device`),
streams its progress as JSON lines, and writes the tables to a file the parent loads and checks (`build_child`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from glyd_engine.errors import GlydError
from glyd_engine.progress import Cancelled, CancelToken, ProgressCallback, ProgressEvent, no_progress
from glyd_engine.tables.kv_tables import KVTables


def wanted() -> bool:
    """Whether this process should build in a child: a CUDA GPU is there and this process has no context yet."""
    import torch

    from glyd_engine import options as opt

    if opt.TABLE_BUILD_DEVICE.read() == "cpu":
        return False
    return torch.cuda.is_available() and not torch.cuda.is_initialized()


def build_in_child(model_dir: Path, fingerprint: str, window: int | None, tokens: int,
                   progress: ProgressCallback = no_progress, cancel: CancelToken | None = None) -> KVTables:
    """`build.build_tables` run by a child process; its progress relayed, its error raised here as a GlydError."""
    with tempfile.TemporaryDirectory(prefix="glyd-kv-build-") as tmp:
        out, err = Path(tmp) / "tables.safetensors", Path(tmp) / "stderr"
        cmd = [sys.executable, "-m", "glyd_engine.tables.build_child", str(model_dir), str(window or 0), str(tokens),
               str(out)]
        with open(err, "w") as err_f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_f, text=True)
            try:
                assert proc.stdout is not None
                for line in proc.stdout:  # an event every calibration run: cancel is seen within one
                    if cancel is not None and cancel.cancelled:
                        raise Cancelled("cancelled")
                    if line.startswith("{"):
                        progress(ProgressEvent(**json.loads(line)))
                rc = proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if rc != 0:
            tail = err.read_text(errors="replace").strip().splitlines()[-1:] or ["no message"]
            raise GlydError(f"the KV table build for {model_dir} failed in its child process (exit {rc}): {tail[0]}")
        return KVTables.load(out, fingerprint)
