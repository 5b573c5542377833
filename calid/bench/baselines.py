"""The systems calid is measured against, and the options every benchmark shares.

* llama.cpp's own generation (llama-cpp-python's ``Llama``) of the same GGUF file,
  same prompts, same threads, greedy: the best CPU peer on these machines.
* HF transformers ``generate`` on the same (dequantized) weights: the torch peer.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from calid.backends import BACKENDS, DTYPE_CHOICES


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="calid's backend (auto: llama.cpp on CPU for GGUF models, else torch)")
    p.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="torch dtype (auto: by the CPU's bf16 support)"
    )


class LlamaCppOwn:
    """llama.cpp decoding a GGUF by itself: ``Llama.generate`` with greedy sampling, one sequence."""

    name = "llama.cpp own generate"

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def generate(self, ids: list[int], max_new: int, eos_ids: frozenset[int] = frozenset()) -> list[int]:
        """Greedy continuation of ``ids``: ``max_new`` tokens, or fewer when it emits one of ``eos_ids``."""
        self.llm.reset()
        out = []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) >= max_new or token in eos_ids:
                break
        return out

    def external(self, eos_ids: frozenset[int]):
        """As a side_by_side External (stops at EOS, like calid's own configurations)."""
        return lambda ids, n: self.generate(ids, n, eos_ids)
