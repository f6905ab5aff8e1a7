"""One module per `glyd` subcommand; see glyd_engine.cli."""
