"""Progress bars for long work (downloads, conversion, benchmarks) on stderr."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress(total=None, desc: str = "", unit: str = "it", enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr; redraws sparsely when stderr is not a terminal (CI logs)."""
    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not enabled,
        mininterval=0.2 if interactive else 5.0,
        file=sys.stderr,
        dynamic_ncols=True,
        **kw,
    )
