"""Prompts prefilled on weights llama.cpp did not repack, where that is faster.

At load llama.cpp repacks a GGUF's quantized matrices into the layout of its CPU kernels ("extra buffer
types"), which makes a decode step faster; but on some CPUs its kernel for many rows of a repacked K-quant
runs slower than the plain one. Timed in process on a 2-core Xeon (family 6 model 167, AVX-512), one
sequence, ms a forward, repacked / plain: Qwen2.5-Coder 1.5B Q4_K_M 1 token 67 / 81, 16 tokens 247 / 290,
32 tokens 426 / 404, 64 tokens 794 / 672, 256 tokens 2982 / 2242; its Q4_0 draft 1 token 32 / 36, 256 tokens
1377 / 1757. So which weights a prompt should meet depends on CPU and model, and is measured.

``PlainPrefill`` is a second llama.cpp context on the same GGUF loaded without repacking (its weights are
the file's pages, mmapped). The runner (calid.runtime.llamacpp) feeds a forward's prompt runs there when
they bring at least ``PLAIN_MIN_TOKENS`` tokens together, then copies each sequence's whole stream into its slot
(llama_state_seq_get_data / set_data: 7.3 MB and 5 ms for 256 tokens of Qwen 1.5B). The context keeps
what it computed, so a prompt's next chunk (SARATHI) continues where the last one ended; a stream it does
not hold (a prompt-cache prefix, a sequence that decoded since) is first copied over from the runner.
llama.cpp moves a sequence's state only between contexts of as many KV streams, so this one mirrors the
runner's slots and cells: it holds as much KV memory again.

Whether a runner gets one is calid.runtime.prefill_weights' choice.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from calid.errors import CalidError

PLAIN_MIN_TOKENS = 64  # a forward's prompt runs go to the plain weights when they bring this many tokens together
PLAIN_RUN_TOKENS = 16  # a prompt run is at least this long and asks for its last row only (not a decode step, not a
# verification): the matmuls' rows count, not one sequence's (ms repacked / plain, Qwen 1.5B: 8 sequences x 4
# tokens 484 / 403, 4 x 4 280 / 272, 16 x 1 246 / 287)


class PrefillWeightsError(CalidError, ValueError):
    """An unknown prefill_weights choice, or a stream llama.cpp would not move between two contexts."""


class PlainPrefill:
    """A context on the unrepacked weights with the runner's slots, and the tokens each of its streams holds.
    The runner never asks it to read a slot llama.cpp still owes a copy (LlamaCppRunner._stale)."""

    def __init__(self, lib, gguf: Path, n_ctx: int, n_batch: int, n_ubatch: int, slots: int, threads: int):
        self._lib = lib
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = False
        self._model = lib.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self._model:
            raise PrefillWeightsError(f"llama.cpp could not load {gguf.name} a second time (plain weights)")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = n_ctx, n_batch, n_ubatch, slots
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False  # as many streams as the runner's: llama.cpp moves a sequence only so
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self._model, cparams)
        if not self.ctx:
            self.close()
            raise PrefillWeightsError(f"llama.cpp could not create a prefill context for {gguf.name}")
        self._mem = lib.llama_get_memory(self.ctx)
        self._held: dict[int, list[int]] = {}  # slot -> the tokens this context's stream holds
        self._buf = (ctypes.c_uint8 * 0)()
        self.copied_bytes = 0

    def prepare(self, slot: int, before: list[int], runner_ctx) -> None:
        """Make this context's stream ``slot`` hold exactly ``before`` (the sequence's cached tokens)."""
        held, n = self._held.get(slot), len(before)
        if held is not None and len(held) >= n and held[:n] == before:
            if len(held) > n:
                self._lib.llama_memory_seq_rm(self._mem, slot, n, -1)
        elif n == 0:
            self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        else:
            self._copy(runner_ctx, self.ctx, slot)
        self._held[slot] = list(before)

    def store(self, slot: int, tokens: list[int], runner_ctx) -> None:
        """Copy stream ``slot`` (``tokens``, just prefilled here) into the runner's slot of the same number."""
        self._copy(self.ctx, runner_ctx, slot)
        self._held[slot] = list(tokens)

    def forget(self) -> None:
        """After a failed forward: nothing here is trusted."""
        for slot in self._held:
            self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._held.clear()

    def _copy(self, src_ctx, dst_ctx, slot: int) -> None:
        lib = self._lib
        size = lib.llama_state_seq_get_size(src_ctx, slot)
        if size > len(self._buf):
            self._buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_seq_get_data(src_ctx, self._buf, size, slot)
        if not got or lib.llama_state_seq_set_data(dst_ctx, self._buf, got, slot) != got:
            self.forget()
            raise PrefillWeightsError(f"llama.cpp could not move sequence slot {slot} between its contexts")
        self.copied_bytes += got

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "_model", None):
            self._lib.llama_model_free(self._model)
            self._model = None
