"""Where a llama.cpp runner prefills its prompts: on the weights as llama.cpp repacks them, or on a plain copy.

``prefill_weights`` decides (calid.runtime.plain_prefill says why the choice exists): ``repacked`` (one
context), ``plain`` (prompt runs always on a second context over the unrepacked weights), ``auto`` (the
second context only where a prompt-sized forward measured at least 10% faster through it, copies between
the contexts included; the verdict kept per file, CPU and thread count in
$CALID_HOME/calibration/prefill-weights.json, so each machine times it once).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from calid.paths import cache_dir
from calid.runtime.plain_prefill import PLAIN_MIN_TOKENS, PrefillWeightsError
from calid.verdicts import read_verdicts, verdict_key, write_verdict

CHOICES = ("auto", "repacked", "plain")
TIMED_TOKENS = 192  # auto times a prefill of this many tokens both ways
MIN_GAIN = 0.9  # auto splits only when the plain weights are at least 10% faster
VERDICTS = "prefill-weights.json"


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise PrefillWeightsError(f"unknown prefill_weights {choice!r} (choose from {', '.join(CHOICES)})")
    return choice


def time_prefill(gguf: Path, threads: int, tokens: int = TIMED_TOKENS, repeats: int = 3) -> tuple[float, float]:
    """ms of a ``tokens``-token prefill on the repacked weights and on the plain ones (median of ``repeats``,
    taken in turn). On a thread of its own that ends with it (llama.cpp's OpenMP team belongs to the calling
    thread: calid.models.draft_weights.step_ms)."""
    with ThreadPoolExecutor(1, thread_name_prefix="calid-timing") as pool:
        return pool.submit(_prefill_ms, gguf, threads, tokens, repeats).result()


def _prefill_ms(gguf: Path, threads: int, tokens: int, repeats: int) -> tuple[float, float]:
    from calid.runtime.llamacpp import LlamaCppRunner
    from calid.runtime.runner import SeqInput

    runner = LlamaCppRunner(gguf, kv_budget_bytes=64 << 20, threads=threads, slots=2, exact=False,
                            prompt_cache=False, plain_prefill=True)
    try:
        prompt = list(range(1000, 1000 + tokens))
        times: dict[int | float, list[float]] = {PLAIN_MIN_TOKENS: [], float("inf"): []}
        for k in range(repeats + 1):  # the first of each is a warm-up
            for at in times:
                runner.plain_min_tokens = at
                t = time.perf_counter()
                runner.forward([SeqInput("timing", prompt)])
                if k:
                    times[at].append((time.perf_counter() - t) * 1000)
                runner.release("timing")
        return statistics.median(times[float("inf")]), statistics.median(times[PLAIN_MIN_TOKENS])
    finally:
        runner.close()


def prefill_weights(gguf: Path, choice: str, threads: int, cpu: str,
                    say: Callable[[str], None] = lambda line: None) -> bool:
    """Should the runner prefill on plain weights (``choice`` of CHOICES; ``cpu`` names this machine's CPU
    for auto's kept verdict)?"""
    check_choice(choice)
    if choice != "auto":
        return choice == "plain"
    verdicts = cache_dir("calibration") / VERDICTS
    key = verdict_key(gguf, threads, cpu)
    verdict = read_verdicts(verdicts).get(key)
    if verdict is None:
        repacked_ms, plain_ms = time_prefill(gguf, threads)
        verdict = {"plain": plain_ms <= MIN_GAIN * repacked_ms, "tokens": TIMED_TOKENS,
                   "repacked_ms": round(repacked_ms, 1), "plain_ms": round(plain_ms, 1)}
        write_verdict(verdicts, key, verdict)
    timing = f"{verdict['tokens']} tokens {verdict['repacked_ms']} ms repacked, {verdict['plain_ms']} ms plain"
    say(f"[calid] {gguf.name}: prompts prefilled on {'plain' if verdict['plain'] else 'repacked'} weights "
        f"({timing}; prefill_weights=repacked|plain overrides)")
    return bool(verdict["plain"])
