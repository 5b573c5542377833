"""Measured choices kept per model file, CPU and thread count, under $CALID_HOME/calibration.

A choice timed once on this machine (a draft's weights, where a target prefills) is kept in a small JSON file
so that the next start reads it instead of timing again. The file is only a cache: unreadable, it is timed
again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def verdict_key(gguf: Path, threads: int, cpu: str) -> str:
    flags = hashlib.sha256(cpu.encode()).hexdigest()[:12]
    return f"{gguf.name}:{gguf.stat().st_size}:{threads}t:{flags}"


def read_verdicts(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: time again


def write_verdict(path: Path, key: str, verdict: dict) -> None:
    """Add ``verdict`` under ``key``; written under a temporary name and moved into place."""
    data = read_verdicts(path)
    data[key] = verdict
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
