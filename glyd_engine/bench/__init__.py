"""Benchmarks behind `glyd bench`: each returns a dict of figures (printed as JSON by the CLI)."""
