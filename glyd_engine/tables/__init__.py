"""Per-model KV exponent tables: built once from calibration text, cached by model fingerprint."""

from glyd_engine.tables.build import build_tables, ensure_tables, tables_path
from glyd_engine.tables.kv_tables import KVTables

__all__ = ["KVTables", "build_tables", "ensure_tables", "tables_path"]
