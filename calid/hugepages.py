"""Weights on transparent huge pages: glibc's ``malloc`` asked to back its large allocations with 2 MiB pages.

A decode step reads every weight once. llama.cpp repacks the GGUF's weights into memory it allocates with
``malloc`` (and keeps its KV cache there too), and on Linux that memory comes in 4 KiB pages unless the process
asks otherwise: a 1.1 GB read then walks about 270,000 pages a step, each a TLB miss, and in a virtual machine
each miss walks two page tables. Most kernels ship THP in ``madvise`` mode (a region gets huge pages only if its
owner asks), and llama.cpp does not ask. glibc can ask for it (since 2.35): the tunable ``glibc.malloc.hugetlb=1``
makes ``malloc`` madvise its mmap'd chunks as huge-page memory. glibc reads tunables once, as a process starts,
so it is set in the environment of the processes that load models:

- the ``calid`` command re-executes itself once with it (``reexec``), before anything is loaded;
- an embedded Ray's processes inherit it from the driver's environment (serve_app.cluster.local);
- a cluster's nodes get it from ``cluster.yaml``'s ``ray start`` lines.

Measured on a 2-core Xeon VM (Qwen2.5-Coder 1.5B Q4_K_M, one request, greedy, 4 HumanEval prompts, alternating
processes): 66.5 ms a token on 4 KiB pages, 58.4 ms with the tunable (2.6 GB of the process on huge pages).
llama-server gains the same when started with it (67 -> 58 ms). ``CALID_HUGEPAGES=0`` turns it off.

Pure: no Ray, no model.
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
TUNABLES_ENV = "GLIBC_TUNABLES"
SWITCH_ENV = "CALID_HUGEPAGES"  # "0": leave malloc as it is
REEXEC_ENV = "CALID_HUGEPAGES_REEXEC"  # set by the re-executed process: never a second time
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's THP mode (always | madvise | never), None where it has none (not Linux, no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def why_not(env: Mapping[str, str] = os.environ, mode: str | None = None, libc: str | None = None) -> str | None:
    """Why huge pages cannot or should not be asked for here (None: they can)."""
    if env.get(SWITCH_ENV) == "0":
        return f"{SWITCH_ENV}=0"
    libc = _machine()[0] if libc is None else libc
    if libc != "glibc":
        return "not glibc"
    mode = _machine()[1] if mode is None else mode
    if mode not in ("always", "madvise"):
        return f"transparent huge pages {mode or 'unavailable'}"
    return None


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str | None]:
    """This machine's C library and THP mode, read once (libc_ver scans the interpreter's binary; stats() and
    every benchmark line ask)."""
    return platform.libc_ver()[0], thp_mode()


def with_tunable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the tunable added to GLIBC_TUNABLES (kept as it is where it is there already)."""
    out = dict(env)
    have = out.get(TUNABLES_ENV, "")
    if TUNABLE not in have.split(":"):
        out[TUNABLES_ENV] = f"{have}:{TUNABLE}" if have else TUNABLE
    return out


def without_tunable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the tunable (for peers a benchmark runs as their users would)."""
    out = dict(env)
    rest = [t for t in out.pop(TUNABLES_ENV, "").split(":") if t and t != TUNABLE]
    if rest:
        out[TUNABLES_ENV] = ":".join(rest)
    return out


def active(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process started with the tunable (glibc read it then; setting it now changes nothing here)."""
    return TUNABLE in env.get(TUNABLES_ENV, "").split(":")


def child_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment for processes that will load models: with the tunable where huge pages can be had."""
    return with_tunable(env) if why_not(env) is None else dict(env)


def reexec(argv: list[str] | None = None) -> None:
    """Start this program again, the same way, with the tunable (returns only where that is not needed or not
    possible). ``argv``: the interpreter's own command line (default ``sys.orig_argv``)."""
    if active() or why_not() is not None or os.environ.get(REEXEC_ENV):
        return
    argv = list(argv or getattr(sys, "orig_argv", []))
    if not argv:
        return
    env = with_tunable(os.environ)
    env[REEXEC_ENV] = "1"
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:  # cannot re-execute (an embedded interpreter): go on with 4 KiB pages
        return


def describe(env: Mapping[str, str] = os.environ) -> str:
    """One phrase for start-up lines and benchmark headers."""
    reason = why_not(env)
    if active(env) and reason is None:
        return f"huge pages ({TUNABLE}, THP {_machine()[1]})"
    return f"4 KiB pages ({reason or 'started without ' + TUNABLE})"
