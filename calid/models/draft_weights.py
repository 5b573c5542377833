"""A llama.cpp draft's weights in the format this CPU runs fastest.

A draft is worth what it costs. Quantized GGUFs of models whose hidden size is
not a multiple of 256 cannot use the K-quants their name promises: Qwen2.5's
0.5B (896 wide) ships as "Q4_K_M" with 133 of its 169 matrices in Q5_0, a type
llama.cpp's CPU backend runs without the repacked kernels it has for Q4_0 and
the K-quants. On the 2-core Xeon (AVX-512, AMX) a step of four rows took 99 ms
as shipped and 57 ms as Q4_0, one row 51 against 35 ms, a 256-token prefill
2.4 s against 1.5 s, while the 1.5B target took 166 ms for four rows: the
shipped draft was only 1.7x cheaper than the model it drafts for.

``draft_weights`` chooses:
  as-is  the GGUF as given;
  q4_0   a Q4_0 copy of it, made once with llama.cpp's own quantizer
         (requantized from the shipped types: a little lossier) and kept
         beside the original under $CALID_HOME/gguf;
  auto   the faster of the two on this machine: both timed once (one row and
         four rows, the steps a draft takes), the verdict kept per file, CPU
         and thread count in $CALID_HOME/calibration/draft-weights.json.
Lossless modes give the same tokens whichever draft drafts; filter keeps the
draft's confident tokens, so its output can change with the draft's weights
(docs/models.md: the draft's weights).
"""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from calid.errors import CalidError
from calid.paths import cache_dir
from calid.verdicts import read_verdicts, verdict_key, write_verdict

CHOICES = ("auto", "as-is", "q4_0")
TIMED_ROWS = (1, 4)  # a draft's steps: one request alone, and a few together
MIN_GAIN = 0.95  # auto takes the copy only when it is at least 5% faster at every timed size
VERDICTS = "draft-weights.json"


class DraftWeightsError(CalidError, ValueError):
    """An unknown draft_weights choice, or a copy llama.cpp could not make."""


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise DraftWeightsError(f"unknown draft_weights {choice!r} (choose from {', '.join(CHOICES)})")
    return choice


def q4_0_path(gguf: Path) -> Path:
    """Where the Q4_0 copy of ``gguf`` lives (named by the original's file and size)."""
    return cache_dir("gguf") / f"{gguf.stem}.{gguf.stat().st_size}.q4_0.gguf"


def make_q4_0(gguf: Path, threads: int) -> Path:
    """The Q4_0 copy of ``gguf``, quantized now unless it exists; written under a temporary name and moved
    into place, so a replica starting meanwhile never reads half a file."""
    out = q4_0_path(gguf)
    if out.is_file():
        return out
    from calid.runtime.llamacpp import _lib

    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = lib.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = threads
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
    try:
        rc = lib.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            raise DraftWeightsError(f"llama.cpp could not quantize {gguf.name} to Q4_0 (code {rc})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def step_ms(ggufs: list[Path], threads: int, rows=TIMED_ROWS, repeats: int = 5, rounds: int = 2
            ) -> list[dict[int, float]]:
    """For each GGUF, ms of a decode step of ``n`` rows (each its own sequence, 64 tokens in) for n in
    ``rows``: the median of ``repeats`` steps, the least over ``rounds`` taken in turn with the other files,
    so that a busy moment of the machine does not decide between them. Timed on a thread of its own that ends
    with it: llama.cpp's OpenMP team belongs to the calling thread, and a team left behind on a server's
    start-up thread, beside the thread its forwards run on, would slow every later forward (libgomp sleeps
    its threads at each barrier once it counts more threads than cores)."""
    with ThreadPoolExecutor(1, thread_name_prefix="calid-timing") as pool:
        return pool.submit(_step_ms, ggufs, threads, rows, repeats, rounds).result()


def _step_ms(ggufs: list[Path], threads: int, rows, repeats: int, rounds: int) -> list[dict[int, float]]:
    from calid.runtime.llamacpp import LlamaCppRunner
    from calid.runtime.runner import SeqInput

    width = max(rows)
    runners = [LlamaCppRunner(g, kv_budget_bytes=64 << 20, threads=threads, slots=width, exact=False,
                              prompt_cache=False) for g in ggufs]
    try:
        prompt = list(range(1000, 1000 + 64 + rounds * repeats * len(rows)))
        seqs = [f"time{i}" for i in range(width)]
        for runner in runners:
            runner.forward([SeqInput(s, prompt[:64]) for s in seqs])
        best = [dict.fromkeys(rows, float("inf")) for _ in runners]
        at = 64
        for _ in range(rounds):
            for runner, out in zip(runners, best):
                for n in rows:
                    times = []
                    for k in range(repeats):
                        t = time.perf_counter()
                        runner.forward([SeqInput(s, [prompt[at + k]]) for s in seqs[:n]])
                        times.append((time.perf_counter() - t) * 1000)
                    out[n] = min(out[n], statistics.median(times))
            at += repeats
        return best
    finally:
        for runner in runners:
            runner.close()


def faster(shipped: dict[int, float], copy: dict[int, float]) -> bool:
    """Does the copy pay: at least 5% faster at every timed size?"""
    return all(copy[n] <= MIN_GAIN * shipped[n] for n in shipped)


def _copy_or_none(gguf: Path, threads: int, say: Callable[[str], None]) -> Path | None:
    try:
        return make_q4_0(gguf, threads)
    except (DraftWeightsError, OSError) as e:
        say(f"[calid] draft weights: keeping {gguf.name} as shipped ({e})")
        return None


def draft_weights(gguf: Path, choice: str, threads: int, cpu: str,
                  say: Callable[[str], None] = lambda line: None) -> Path:
    """The GGUF the draft should load for ``choice`` (CHOICES); ``cpu`` names this machine's CPU for auto's
    cached verdict. auto falls back to the shipped file, saying why, when the copy cannot be made."""
    check_choice(choice)
    if choice == "as-is":
        return gguf
    if choice == "q4_0":
        return make_q4_0(gguf, threads)
    verdicts = cache_dir("calibration") / VERDICTS
    key = verdict_key(gguf, threads, cpu)
    verdict = read_verdicts(verdicts).get(key)
    if verdict is None:
        copy = _copy_or_none(gguf, threads, say)
        if copy is None:
            return gguf
        shipped_ms, copy_ms = step_ms([gguf, copy], threads)
        verdict = {"q4_0": faster(shipped_ms, copy_ms),
                   "shipped_ms": {str(n): round(v, 1) for n, v in shipped_ms.items()},
                   "q4_0_ms": {str(n): round(v, 1) for n, v in copy_ms.items()}}
        write_verdict(verdicts, key, verdict)
    timing = ", ".join(f"{n} row{'s' * (n != '1')} {verdict['shipped_ms'][n]} -> {verdict['q4_0_ms'][n]} ms"
                       for n in verdict["shipped_ms"])
    if not verdict["q4_0"]:
        say(f"[calid] draft weights: {gguf.name} as shipped (a Q4_0 copy is not 5% faster here: {timing})")
        return gguf
    copy = _copy_or_none(gguf, threads, say)  # made when timed; made again if it was deleted since
    if copy is None:
        return gguf
    say(f"[calid] draft weights: a Q4_0 copy of {gguf.name}, faster on this CPU ({timing}; "
        "draft_weights=as-is keeps the shipped file)")
    return copy
