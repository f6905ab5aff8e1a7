"""glyd-chat: the terminal chat on Glyd's engine.

Importing this package (and `glyd_app.__main__`) stays cheap: Textual loads when the app runs, torch
and vLLM never load in this process (the engine runs in a child process, see glyd_engine.engine).
"""
