"""The text side of a GGUF model without its weights: tokenizer, config and generation config.

The llama.cpp backend reads the weights from the GGUF file itself; calid still
needs the tokenizer (chat template, streaming text) and a few config facts.
They are extracted once into a small folder (a few MB, seconds) beside the
model cache; a preset already converted for torch reuses its folder.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from calid.models.convert import building, is_converted
from calid.paths import cache_dir

DONE_MARKER = "calid-meta.json"


def gguf_companion(spec: str, gguf: Path) -> Path:
    """A folder with the tokenizer, config.json and generation_config.json of ``gguf``."""
    converted = cache_dir("models") / spec
    if is_converted(converted):
        return converted
    stat = gguf.resolve().stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir("gguf-meta") / f"{gguf.stem}-{key}"
    if (out / DONE_MARKER).is_file():
        return out
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with building(out, f"read the tokenizer of {gguf.name}") as tmp:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / DONE_MARKER).write_text(json.dumps({"source": str(gguf)}) + "\n")
    return out
