"""Finding model directories: the built-in demo model, local directories and Hugging Face downloads.

Everything that needs a model goes through `resolve_model`, so "demo" works offline on a fresh machine and a
partly built or partly downloaded model is never mistaken for a finished one. The modules: `resolve` (a spec
to a directory and a display name), `demo` (the demo build), `hub` (downloads), `local` (the models
directory). What is true of the files themselves (validation, headers, the fingerprint) is in
`glyd_engine.format`, re-exported here. Nothing here imports torch at import time (the app lists models).
"""

from glyd_engine.format.fingerprint import model_fingerprint
from glyd_engine.format.model_dir import model_dtype_report, validate_model_dir
from glyd_engine.models.demo import (
    CHATML_TEMPLATE,
    DEMO_GENERATION,
    DEMO_GGUF_MEMBER,
    DEMO_GGUF_SHA256,
    DEMO_MODEL_ID,
    DEMO_NAME,
    DEMO_RECIPE_VERSION,
    DEMO_WHEEL_ENV,
    DEMO_WHEEL_FILE,
    DEMO_WHEEL_REQ,
    build_demo_model,
    demo_model_path,
    ensure_demo_model,
    fetch_demo_wheel,
    installed_demo_wheel,
)
from glyd_engine.models.hub import HUB_PATTERNS, hub_model_path
from glyd_engine.models.local import MARKER, LocalModel, list_local_models
from glyd_engine.models.resolve import display_name, resolve_local, resolve_model

__all__ = [
    "CHATML_TEMPLATE", "DEMO_GENERATION", "DEMO_GGUF_MEMBER", "DEMO_GGUF_SHA256", "DEMO_MODEL_ID", "DEMO_NAME",
    "DEMO_RECIPE_VERSION", "DEMO_WHEEL_ENV", "DEMO_WHEEL_FILE", "DEMO_WHEEL_REQ", "HUB_PATTERNS", "MARKER",
    "LocalModel", "build_demo_model", "demo_model_path", "display_name",
    "ensure_demo_model", "fetch_demo_wheel", "hub_model_path", "installed_demo_wheel", "list_local_models",
    "model_dtype_report", "model_fingerprint", "resolve_local", "resolve_model",
    "validate_model_dir",
]
