"""The few numbers a Llama-family decoder needs, read from a HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from calid.errors import ModelSourceError

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED:
            raise ModelSourceError(f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelSourceError(f"rope type {rope_type!r} is not supported yet (only default RoPE)")
        heads = raw["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))
