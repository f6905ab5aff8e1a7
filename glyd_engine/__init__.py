"""Glyd's engine side: the lossless bf16 formats, per-model tables, models, and the vLLM plugin.

Nothing here imports Textual; the heavy imports (torch, vLLM) happen inside the modules that need them,
so `import glyd_engine` stays cheap for the app and the CLI.
"""

__version__ = "0.1.0"
