"""The attention shape of a model, read from its config.json (no torch, no transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glyd_engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_kv_heads: int
    head_size: int
    max_positions: int

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> AttentionShape:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise UnsupportedModelError(f"{model_dir} has no config.json: not a model directory") from exc
        except json.JSONDecodeError as exc:
            raise UnsupportedModelError(f"{path} is not valid JSON ({exc})") from exc
        return cls.from_config(cfg, str(path))

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> AttentionShape:
        """The shape from a parsed config.json (a hub download checks it before fetching the weights)."""
        cfg = cfg.get("text_config", cfg)
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_size = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise UnsupportedModelError(f"{where} does not describe a decoder with standard attention "
                                        f"(missing {exc}); Glyd's KV tables need num_hidden_layers, "
                                        "num_attention_heads and hidden_size or head_dim") from exc
        return cls(layers, kv_heads, head_size, int(cfg.get("max_position_embeddings") or 4096))
