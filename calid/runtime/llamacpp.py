"""LlamaCppRunner: the ModelRunner interface on llama.cpp, straight from a GGUF file.

The workers speak to a runner in token ids (``sync``, ``forward``, ``compact``,
``release``; see calid.runtime.runner). This runner keeps every calid sequence
in a *slot*: a llama.cpp sequence id with its own KV stream (``kv_unified``
off). Own streams make each sequence's logits bit-identical whatever else
shares the batch or the cache (measured: with one unified cache, a second
sequence in the same batch moved logits by up to 2.8), which is what lets
greedy speculative, tree and Lookahead decoding reproduce ``ar`` token for token.

* all sequences of a forward in one ``llama_decode`` (ragged, own positions,
  logits only at the rows asked for), or, in exact mode (the default), in a
  few: whole 32-position blocks of a prompt in one call each, everything else
  in calls of at most 3 rows, because llama.cpp's repacked K-quant matmuls
  round a row differently by its place in a larger batch (``_calls``);
* rollback to any length is ``llama_memory_seq_rm`` of the tail;
* prefix reuse: a new sequence copies the stream of the live sequence that
  shares the longest prefix with it (same cell layout, so same numerics) and
  trims it, instead of recomputing; in batched mode a released sequence's
  stream also stays in its slot until the slot is needed (a prompt cache: the
  next chats with the same system prompt, or the next turn of a conversation,
  copy its prefix instead of prefilling it);
* token trees (``SeqInput.ancestors``): one slot per branch (root-to-leaf
  path; calid.runtime.seq_cover checks the mask is exactly that): the first
  is fed in the sequence's own slot, each other in a copy of its stream, every
  branch its own path, so every node sees exactly its ancestors. ``compact`` adopts the accepted branch's slot as
  the sequence's
  (no copy back) and frees the others;
* the KV budget sets the cells per slot (the longest sequence) for a fixed
  number of slots; when slots run out the least recently used sequence is
  evicted and recomputed from its ids on its next forward.

Terms: *slot* = llama.cpp sequence id and its KV stream; *cells* = KV entries.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable

import numpy as np
import torch

from calid.hugepages import describe as pages
from calid.errors import CalidError
from calid.runtime.plain_prefill import PLAIN_MIN_TOKENS, PLAIN_RUN_TOKENS, PlainPrefill
from calid.runtime.runner import RunnerStats, SeqInput
from calid.runtime.seq_cover import cover
from calid.runtime.twins import forward_sharing

DEFAULT_SLOTS = 32
DEFAULT_CELLS_PER_SLOT = 2048
EXACT_ROWS = 3  # llama.cpp's CPU matmuls give the same rows as a one-token step up to this many rows
BLOCK = 32  # exact mode prefills whole position blocks of this size in one call each
MIN_BORROW = 16  # a shorter shared prefix is recomputed rather than copied (a copy moves the whole stream)
N_UBATCH = 512
MAX_VIEWS = 256  # logits views kept (_logits): a few row counts at the few addresses llama.cpp's buffer takes


class LlamaCppError(CalidError):
    """llama.cpp could not load a model or run a forward."""


def _lib():
    # llama.cpp's OpenMP threads run on the libgomp.so.1 torch loaded at import (same soname), which read
    # OMP_WAIT_POLICY then: setting it here would not reach them, only every process started from here on.
    # It once did (PASSIVE): the Ray workers of a driver that had loaded a model (calid bench modes, the tests)
    # waited passively, and a served Qwen 1.5B decode step took 51 ms instead of 40 with libgomp's default
    # (spin a little, then sleep); a fully active policy starves the other replicas. The default stays.
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as exc:  # pragma: no cover - exercised only without the package
        raise LlamaCppError("the llama.cpp backend needs llama-cpp-python (bash scripts/test.sh or "
                            "scripts/demo.sh install it); use --backend torch") from exc
    verbose = os.environ.get("CALID_LLAMA_VERBOSE", "") == "1"
    _logger.logger.setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    return llama_cpp


def _address_of_logits(lib):
    """llama_get_logits returning the buffer's address as an int: llama-cpp-python's binding returns a float
    pointer, which a step then cast to an address (a ctypes cast per forward)."""
    fn = lib.llama_cpp._lib["llama_get_logits"]  # a function object of its own: the binding's keeps its types
    fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_void_p
    return fn


def default_threads() -> int:
    """CPUs this process may run on (a Ray replica's affinity, a container's CPU set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def ubatches(slots: list[int], n_ubatch: int = N_UBATCH) -> list[tuple[int, int]]:
    """The (sequences, tokens each) of the ubatches llama.cpp splits a batch into when every sequence has its own
    KV stream (llama_batch_allocr::split_equal, sequential), for a batch given as the slot of each token in
    slot order: from the lowest slot with tokens left, the run of adjacent slots that have tokens left, as many
    tokens each as the run's shortest has (and n_ubatch allows). Each ubatch reads every weight once."""
    left = Counter(slots)
    out = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left and len(run) < n_ubatch:
            run.append(run[-1] + 1)
        n = min(min(left[s] for s in run), max(1, n_ubatch // len(run)))
        for s in run:
            left[s] -= n
            if not left[s]:
                del left[s]
        out.append((len(run), n))
    return out


@dataclass
class _Tree:
    """A tree forward's branch slots, kept until ``compact`` picks the accepted one."""

    slots: list[int]
    member: np.ndarray  # [nodes, branches] bool: node i lies on branch k
    tokens: list[int]  # the nodes' ids (the tree's new tokens after the shared committed ones)
    positions: list[int]
    first: int  # branch fed in the sequence's own slot; kept when no node is accepted


@dataclass
class _RowsRead:
    """What one forward reads of its output rows: each flagged entry's SeqInput.reads, and for greedy chains with
    SeqInput.expect each row's (input, expected token). A chain's rows are read in order up to the first whose
    argmax misses its expected token; the rest, which its verdict never reads, are not (a HumanEval answer at one
    request verifies copies of up to 32 tokens, a row's argmax over Qwen's 152k logits costs 0.02-0.04 ms)."""

    reads: dict[int, str]
    checks: dict[int, tuple[int, int | None]]
    stopped: set[int] = field(default_factory=set)

    def top1(self, entry: int, row: np.ndarray) -> int | None:
        check = self.checks.get(entry)
        if check is None:
            return int(row.argmax())
        k, expected = check
        if k in self.stopped:
            return None
        top = int(row.argmax())
        if top != expected:
            self.stopped.add(k)
        return top


@dataclass
class _Seq:
    slot: int
    tokens: list[int] = field(default_factory=list)  # ids whose K/V the slot holds
    tree: _Tree | None = None
    # exact mode: the leading tokens whose K/V came from whole-block calls (a multiple of BLOCK), what another
    # sequence may borrow: its own prefill would compute the same blocks the same way (_borrow)
    blocked: int = 0


class LlamaCppRunner:
    """``slots`` sequences at most (requests, draft lanes and tree branches together), each up to
    ``kv_budget_bytes / slots`` of KV cells; ``threads`` defaults to the CPUs this process may use; ``repack``:
    llama.cpp's repacked weight layout (the default; faster steps), else the file's own."""

    backend = "llamacpp"

    def __init__(self, gguf: str | Path, kv_budget_bytes: int | None = None, threads: int | None = None,
                 slots: int = DEFAULT_SLOTS, n_batch: int = 2048, exact: bool = True,
                 prompt_cache: bool | None = None, plain_prefill: bool = False, repack: bool = True):
        lib = self._lib = _lib()
        self._logits_at = _address_of_logits(lib)
        gguf = Path(gguf)
        if not gguf.is_file():
            raise LlamaCppError(f"GGUF file not found: {gguf}")
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = repack  # False: the file's own layout (calid.runtime.plain_prefill)
        self._model = lib.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {gguf.name}")
        self.path = gguf
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
        self.cell_bytes = self._kv_bytes_per_token()
        self.cells_per_slot = _cells_per_slot(kv_budget_bytes, slots, self.cell_bytes,
                                              lib.llama_model_n_ctx_train(self._model))
        self.max_position = self.cells_per_slot  # the longest sequence one slot holds
        self.slots = slots
        self.threads = threads or default_threads()
        self.exact = exact
        # released streams kept for their prefixes; off in exact mode, where a prefix computed as another
        # request's decode steps would not be the rows a prefill of this request computes
        self.prompt_cache = not exact if prompt_cache is None else prompt_cache
        self.n_batch = n_batch
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.cells_per_slot * slots
        cparams.n_batch = n_batch
        cparams.n_ubatch = self._n_ubatch = min(N_UBATCH, n_batch)
        cparams.n_seq_max = slots
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.kv_unified = False  # one KV stream per slot: numerics independent of the other sequences
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise LlamaCppError(f"llama.cpp could not create a context of {slots} x {self.cells_per_slot} cells "
                                f"for {gguf.name}")
        self._mem = lib.llama_get_memory(self._ctx)
        # long runs of prompt tokens on unrepacked weights, where this CPU runs those faster (plain_prefill)
        self.plain_min_tokens, self.plain_run_tokens = PLAIN_MIN_TOKENS, PLAIN_RUN_TOKENS
        self._plain = (PlainPrefill(lib, gguf, cparams.n_ctx, n_batch, self._n_ubatch, slots, self.threads)
                       if plain_prefill and not exact else None)
        self._seqs: OrderedDict[Hashable, _Seq] = OrderedDict()  # least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self._kept: OrderedDict[int, list[int]] = OrderedDict()  # prompt cache: slot -> ids it holds, LRU first
        self._synced: set = set()  # synced since the last forward: never evicted before it runs
        self._stale: set[int] = set()  # slots copied into since the last decode (_copy_stream)
        self._batch = None
        self._batch_cap = 0
        self._views: dict[tuple[int, int], np.ndarray] = {}  # (logits address, rows) -> a view there (_logits)
        self.evictions = 0
        self.stats = RunnerStats()

    # ---- facts ---------------------------------------------------------------------

    def _kv_bytes_per_token(self) -> int:
        lib, m = self._lib, self._model
        heads, kv_heads = lib.llama_model_n_head(m), lib.llama_model_n_head_kv(m)
        return 2 * lib.llama_model_n_layer(m) * kv_heads * (lib.llama_model_n_embd(m) // heads) * 2  # K+V, f16

    @property
    def weight_bytes(self) -> int:
        return int(self._lib.llama_model_size(self._model))

    @property
    def max_sequences(self) -> int:
        """Sequences one forward may hold: a slot for each request, draft lane and extra tree branch."""
        return self.slots

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.cells_per_slot * self.cell_bytes * (2 if self._plain else 1)

    def describe(self) -> str:
        return (f"llama.cpp {self.path.name}, {self.threads} threads, {self.slots} sequences x "
                f"{self.cells_per_slot} tokens of KV ({self.kv_bytes / 2**20:.0f} MiB), "
                + ("exact (batch-invariant) forwards" if self.exact else "batched forwards")
                + (", prompts prefilled on plain weights" if self._plain else "")
                + f", {pages()}")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back in host memory

    def cached_count(self) -> int:
        return len(self._seqs)

    # ---- the runner interface ------------------------------------------------------

    def cached_length(self, seq_id: Hashable) -> int:
        s = self._seqs.get(seq_id)
        return len(s.tokens) if s else 0

    def cached_prefix(self, seq_id: Hashable, token_ids: list[int]) -> int:
        s = self._seqs.get(seq_id)
        return _common_prefix(s.tokens, token_ids) if s else 0

    def sync(self, seq_id: Hashable, token_ids: list[int], keep_at_most: int | None = None) -> list[int]:
        """Roll the sequence back to its longest common prefix with ``token_ids``; return the ids to feed.

        A sequence new to the cache first copies the longest prefix a live sequence holds.
        At least one id is always returned.
        """
        self._synced.add(seq_id)
        s = self._get(seq_id, self._synced)
        cap = len(token_ids) - 1 if keep_at_most is None else min(keep_at_most, len(token_ids) - 1)
        keep = min(_common_prefix(s.tokens, token_ids), cap)
        if not s.tokens and cap >= MIN_BORROW:
            keep = self._borrow(s, token_ids, cap)
        if keep < len(s.tokens):
            self._trim(s, keep)
        self.stats.recomputed_tokens += max(0, len(token_ids) - 1 - keep)
        return token_ids[keep:]

    def chunk_length(self, start: int, n: int, total: int) -> int:
        """How many of a prompt's ids a prefill chunk of about ``n`` feeds from position ``start`` (``total`` ids
        in all). Exact mode ends a chunk on a block boundary, so that each block is one call however the prompt
        is cut into chunks (a chunk ending mid-block moved a Qwen 1.5B Q4_K_M prompt's last row by 0.37)."""
        if not self.exact or start + n >= total:
            return n
        end = (start + n) // BLOCK * BLOCK
        return min(total - start, end - start if end > start else (start // BLOCK + 1) * BLOCK - start)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        s = self._seqs.get(seq_id)
        if s is not None:
            self._settle(s)
            self._trim(s, min(length, len(s.tokens)))

    def release(self, seq_id: Hashable) -> None:
        self._release(seq_id)
        self._pack()

    def _release(self, seq_id: Hashable) -> None:
        """Free a sequence's slot (or keep its stream for the prompt cache), leaving the others where they are: a
        forward in progress has already placed their tokens by slot."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        self._settle(s)
        if self.prompt_cache and len(s.tokens) >= MIN_BORROW:
            slot, top = s.slot, self._room_above(s.slot)
            if top is not None:  # kept streams gather on the high slots, out of the live sequences' run
                slot = self._move_stream(slot, top)
            self._kept[slot] = s.tokens  # until a new sequence takes its prefix or needs its slot
        else:
            self._free_slot(s.slot)

    def kept_count(self) -> int:
        """Released streams the prompt cache holds."""
        return len(self._kept)

    def compact(self, seq_id: Hashable, rows: list[int], start: int) -> None:
        """After a tree forward: keep cache rows ``rows`` (the accepted path, absolute) after ``start``.

        Rows count as in the torch runner: the sequence's cached tokens, then the forward's tree
        nodes in order. The accepted branch's slot becomes the sequence's slot.
        """
        s = self._seqs[seq_id]
        base = len(s.tokens)  # row of the first tree node
        main = [r for r in rows if r < base]
        nodes = [r - base for r in rows if r >= base]
        if main != list(range(start, start + len(main))):
            raise LlamaCppError("compact: the kept committed rows must be packed after start")
        tree = s.tree
        if tree is None:
            self._trim(s, start + len(main))
            if nodes:
                raise LlamaCppError("compact: no tree forward to keep nodes from")
            return
        at = start + len(main)
        if [tree.positions[n] for n in nodes] != list(range(at, at + len(nodes))):
            raise LlamaCppError("compact: the accepted tree path must lie at consecutive positions")
        # a branch holding the whole path (all branches hold the committed rows)
        self._adopt(s, int(np.flatnonzero(tree.member[nodes[-1]])[0]) if nodes else tree.first)
        s.tokens += [tree.tokens[n] for n in nodes]
        self._trim(s, at + len(nodes))
        self._pack()  # the adopted branch's slot may lie above freed ones

    def forward(self, inputs: list[SeqInput]) -> list[torch.Tensor]:
        """Feed each sequence's new tokens; logits [len(logits_at), V] per sequence (an input that ``reads``
        less: a list of what it reads of each of those rows). Sequences that repeat another's prefill exactly
        (the n choices of a prompt) are fed once and forked (calid.runtime.twins)."""
        def cached(seq_id: Hashable) -> list[int]:
            s = self._seqs.get(seq_id)
            return s.tokens if s is not None else []

        def align(past: int, shared: int) -> int:  # exact mode: a block's rows come from one call (_calls)
            return shared if not self.exact else (past + shared) // BLOCK * BLOCK - past

        return forward_sharing(inputs, cached, self._forward, self._fork, self.stats, align)

    def _fork(self, src: Hashable, dst: Hashable, length: int) -> None:
        leader, twin = self._seqs[src], self._get(dst, {src, dst})
        self._copy_stream(leader.slot, twin.slot)
        twin.tokens, twin.blocked = list(leader.tokens), leader.blocked
        self._trim(twin, length)

    def _forward(self, inputs: list[SeqInput]) -> list[torch.Tensor]:
        """Phase A decodes every chain and the committed tokens of every tree input on the sequence's own
        slot; phase B the tree nodes, each branch on its own slot (a copy of the sequence's stream made
        between the phases). ``_calls`` groups each phase's tokens into llama_decode calls.
        """
        pinned = {inp.seq_id for inp in inputs}
        if len(pinned) != len(inputs):
            raise ValueError("a sequence appears twice in one forward")
        pinned |= self._synced
        entries, wanted, trees = [], [], []  # entries: (token, position, slot); wanted: entries giving logits
        padded = []  # sequences fed SeqInput.pad tokens after their own
        own_slots = {}  # slot -> the sequence fed on it (exact mode counts its whole-block calls: _Seq.blocked)
        plain = {}  # slot -> (sequence, the tokens before its run, the run's first entry): on the plain weights
        runs = {i for i, inp in enumerate(inputs) if self._prompt_run(inp)}
        if sum(len(inputs[i].tokens) for i in runs) < self.plain_min_tokens:
            runs = set()
        for k, inp in enumerate(inputs):
            if not inp.tokens:
                raise ValueError(f"sequence {inp.seq_id!r} has no new tokens")
            s = self._get(inp.seq_id, pinned)
            own_slots[s.slot] = s
            past, q = len(s.tokens), len(inp.tokens)
            if inp.positions is None:  # a chain after the cached tokens (a range: no array to build each step)
                positions, last = range(past, past + q), past + q - 1
            else:
                positions = np.asarray(inp.positions)
                last = int(positions.max())
            if last >= self.cells_per_slot:
                raise LlamaCppError(f"sequence {inp.seq_id!r} reaches position {last}, beyond the "
                                    f"{self.cells_per_slot} tokens of KV per sequence; raise the KV budget")
            at = inp.logits_at if inp.logits_at is not None else [q - 1]
            cov = cover(inp.ancestors.cpu().numpy(), positions) if inp.ancestors is not None else None
            own = q if cov is None else _shared_prefix(cov)  # tokens on the sequence's own slot
            base = len(entries)
            entries += [(t, int(p), s.slot) for t, p in zip(inp.tokens[:own], positions[:own])]
            if k in runs:
                # a stream llama.cpp has not finished copying (it copies between streams at the next decode)
                # cannot be read yet: its first token goes with this context's call, which runs first
                first = int(s.slot in self._stale)
                plain[s.slot] = (s, s.tokens + inp.tokens[:first], base + first)
            s.tokens.extend(inp.tokens[:own])
            if inp.pad > 0 and cov is None and inp.positions is None and not self.exact and s.slot not in plain:
                pad = min(inp.pad, self.cells_per_slot - 1 - last)  # cells dropped after the forward
                entries += [(inp.tokens[-1], last + 1 + i, s.slot) for i in range(pad)]
                padded.append(s)
                self.stats.padded_tokens += pad
            wanted.append([base + i for i in at] if cov is None else None)
            if cov is not None:
                trees.append((len(wanted) - 1, s, inp, positions, at, cov, own, base))
        phase_b = len(entries)
        copies = []
        for k, s, inp, positions, at, cov, own, base in trees:
            wanted[k] = self._tree_nodes(s, inp, positions, at, cov, own, base, entries, copies, pinned)
        flagged = {i for rows in wanted for i in rows}
        reads = {i: inp.reads for inp, rows in zip(inputs, wanted) for i in rows}
        # entry -> (its input, the token its argmax is checked against): a greedy chain's rows are read up to the
        # first that differs (SeqInput.expect); ``stopped``: the inputs whose rows are no longer read
        checks = {i: (k, inp.expect[j] if j < len(inp.expect) else None)
                  for k, (inp, rows) in enumerate(zip(inputs, wanted))
                  if inp.expect is not None and inp.reads == "top1" for j, i in enumerate(rows)}
        rows_read = _RowsRead(reads, checks)
        got = {}  # entry -> its logits row, or what its input reads of it (None: a row not read)
        for lo, hi in ((0, phase_b), (phase_b, len(entries))):
            if lo == phase_b:
                for src, dst in copies:  # after phase A: the copies hold the committed tokens
                    self._copy_stream(src, dst)
            for call in self._calls(entries[lo:hi]):
                # in slot order: llama.cpp splits a batch whose KV streams are out of order into many small
                # ubatches, each reading every weight (12 one-token rows on slots 11..0: 3.5x the time of 0..11)
                call = sorted((lo + i for i in call), key=lambda i: entries[i][2])
                routed = {i for i in call if entries[i][2] in plain and i >= plain[entries[i][2]][2]}
                for part, on_plain in (([i for i in call if i not in routed], False), (sorted(routed), True)):
                    if part:
                        got.update(self._run(entries, part, flagged, rows_read, inputs, plain if on_plain else None))
                if self.exact and lo == 0 and len(call) == BLOCK:  # a whole block of a chain (_calls; not tree
                    # nodes, phase B): after a blocked prefix, blocked too
                    _, position, slot = entries[call[0]]
                    s = own_slots.get(slot)
                    if s is not None and s.blocked == position:
                        s.blocked += BLOCK
        for s in padded:
            self._trim(s, len(s.tokens))
        self.stats.tokens += len(entries)
        self.stats.forwards += 1
        self._synced.clear()
        return [[got[e] for e in rows if got[e] is not None] if inp.reads != "rows"
                else got[rows[0]][None] if len(rows) == 1 else torch.stack([got[e] for e in rows])
                for inp, rows in zip(inputs, wanted)]

    def _calls(self, entries: list) -> list[list[int]]:
        """Group entries into llama_decode calls.

        Not exact: one call. Exact: each run (a slot's consecutive entries) is cut at positions that
        are multiples of BLOCK; a run segment that fills a whole block gets a call of its own, any other
        segment is decoded in pieces of at most EXACT_ROWS rows, so every row is computed the same way
        whatever else shares the forward and however its request was scheduled: a prompt's full blocks
        always in BLOCK-row calls, decode steps, verifications and a prompt's tail by the small-batch
        kernels of a one-token step. (llama.cpp's repacked K-quant matmuls work in tiles of 4 rows: from
        4 rows on, a row's logits depend on its place in the batch; measured on Qwen2.5 Q4_K_M: by up
        to 0.47.) Segments of one run stay in order; the i-th segments of all runs share a round.
        """
        if not self.exact:
            return [list(range(len(entries)))] if entries else []
        runs, start = [], 0
        for i in range(1, len(entries) + 1):
            if i == len(entries) or entries[i][2] != entries[start][2]:
                runs.append(_segments(range(start, i), [entries[j][1] for j in range(start, i)]))
                start = i
        calls = []
        for round_ in range(max(map(len, runs), default=0)):
            small = []
            for seg in (r[round_] for r in runs if round_ < len(r)):
                if len(seg) > EXACT_ROWS:
                    calls.append(seg)
                    continue
                if len(small) + len(seg) > EXACT_ROWS:
                    calls.append(small)
                    small = []
                small = small + seg
            if small:
                calls.append(small)
        return calls

    # ---- trees -----------------------------------------------------------------------

    def _tree_nodes(self, s: _Seq, inp: SeqInput, positions: np.ndarray, at: list[int], cov, own: int,
                    base: int, entries: list, copies: list, pinned: set) -> list[int]:
        """Append a tree's nodes, one slot per branch, to ``entries``; return the entries answering ``at``.

        The committed tokens (the first ``own``, on every branch) went to the sequence's own slot at
        ``base``; the first branch continues there, every other one in a copy of that stream (queued in
        ``copies``), so each node sees exactly its ancestors.
        """
        first = int(cov.query[own]) if own < len(inp.tokens) else 0  # the branch fed on the own slot: no copy
        slots = [s.slot if k == first else self._take_slot(pinned) for k in range(cov.branches)]
        entry_of = {}  # (token index, branch) -> batch entry
        for k, slot in enumerate(slots):
            if k != first:
                copies.append((s.slot, slot))
            for i in np.flatnonzero(cov.member[own:, k]) + own:
                entry_of[i, k] = len(entries)
                entries.append((inp.tokens[i], int(positions[i]), slot))
        s.tree = _Tree(slots, cov.member[own:], list(inp.tokens[own:]), [int(p) for p in positions[own:]], first)
        return [base + i if i < own else entry_of[i, int(cov.query[i])] for i in at]

    def _adopt(self, s: _Seq, branch: int) -> None:
        """End a tree forward: branch ``branch``'s slot (it holds the cached prefix too) becomes the
        sequence's own; every other slot of the tree is freed."""
        tree, s.tree = s.tree, None
        s.slot = tree.slots[branch]
        for k, slot in enumerate(tree.slots):  # the sequence's old slot is one of them (branch ``first``)
            if k != branch:
                self._free_slot(slot)

    def _settle(self, s: _Seq) -> None:
        """A tree forward that was never compacted keeps only its committed tokens."""
        if s.tree is not None:
            self._adopt(s, s.tree.first)
            self._trim(s, len(s.tokens))

    # ---- llama.cpp calls -----------------------------------------------------------

    def _prompt_run(self, inp: SeqInput) -> bool:
        """A run of prompt tokens the plain weights may take: a chain after the cached tokens whose rows asked for
        come after at least ``plain_run_tokens`` tokens and are fewer than the tokens before them. So a prompt,
        and a prompt with a draft chain to judge after it (filter's first call), but not a verification of the
        draft alone (every row) nor a decode step."""
        if self._plain is None or inp.ancestors is not None or inp.positions is not None:
            return False
        at = inp.logits_at if inp.logits_at is not None else [len(inp.tokens) - 1]
        before = min(at, default=len(inp.tokens) - 1)  # tokens before the first row asked for
        return before + 1 >= self.plain_run_tokens and len(at) <= before

    def _run(self, entries: list, call: list[int], flagged: set, reads: "_RowsRead", inputs: list[SeqInput],
             plain: dict | None) -> dict:
        """Decode the entries ``call`` indexes, on this context or (``plain``: slot -> (sequence, the tokens
        before its run, the run's first entry)) on the plain weights' one, whose streams then replace the
        sequences' own; the flagged entries' outputs."""
        ctx = self._ctx
        if plain is not None:
            ctx = self._plain.ctx
            for slot, (_, before, _) in plain.items():
                self._plain.prepare(slot, before, self._ctx)
        try:
            self._decode([entries[i] for i in call], [i in flagged for i in call], inputs, ctx)
            mine = [i for i in call if i in flagged]
            out = dict(zip(mine, self._outputs(mine, reads, ctx))) if mine else {}
            if plain is not None:
                start = time.perf_counter()
                for slot, (s, _, _) in plain.items():
                    self._plain.store(slot, s.tokens, self._ctx)
                self.stats.forward_s += time.perf_counter() - start
                self.stats.plain_prefill_tokens += len(call)
            return out
        except CalidError:
            if plain is not None:
                self._plain.forget()
                for inp in inputs:
                    self._release(inp.seq_id)
            raise

    def _decode(self, entries: list, flags: list[bool], inputs: list[SeqInput], ctx=None) -> None:
        self._ensure_batch(len(entries))
        b = self._batch
        for i, ((t, p, slot), flag) in enumerate(zip(entries, flags)):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = slot
            b.logits[i] = flag
        b.n_tokens = len(entries)
        if entries[0][2] == entries[-1][2]:  # one sequence (a call is in slot order): ubatches' count, directly
            self.stats.ubatches += -(-len(entries) // self._n_ubatch)
        else:
            self.stats.ubatches += len(ubatches([e[2] for e in entries], self._n_ubatch))
        start = time.perf_counter()
        rc = self._lib.llama_decode(ctx or self._ctx, b)
        if ctx is None or ctx == self._ctx:
            self._stale.clear()  # llama.cpp made its pending stream copies before this decode
        self.stats.forward_s += time.perf_counter() - start
        if rc != 0:
            for inp in inputs:  # the cache may hold part of this forward: forget these sequences
                self._release(inp.seq_id)
            raise LlamaCppError(f"llama_decode failed (code {rc}) on {len(entries)} tokens")

    def _outputs(self, mine: list[int], rows_read: "_RowsRead", ctx=None) -> list:
        """The last decode's output rows (of entries ``mine``), in batch order, each as its input reads it
        (SeqInput): "top1" its argmax id (None past a greedy chain's first miss: SeqInput.expect), "top1_nll" that
        and its NLL, both read where llama.cpp left the row, "rows" a copied [V] float32 tensor. On a 2-core CPU,
        right after a decode, a row of Qwen's 152k logits costs 0.6-1.3 ms to copy out and the first torch call of a
        step 0.2-0.9 ms more; a greedy step here makes neither (Qwen 1.5B at one request, in process, time per step
        beside llama_decode: ar 2.8 -> 1.5 ms, auto with its longer verifications 4.7 -> 2.8 ms)."""
        reads = [rows_read.reads[i] for i in mine]
        view = self._logits(ctx or self._ctx, len(reads))
        if all(r == "rows" for r in reads):
            return list(torch.from_numpy(view.copy()))
        if all(r == "top1" for r in reads) and not rows_read.checks:
            return view.argmax(-1).tolist()
        return [rows_read.top1(i, row) if r == "top1" else _top1_nll(row) if r == "top1_nll"
                else torch.from_numpy(row.copy()) for i, row, r in zip(mine, view, reads)]

    def _logits(self, ctx, rows: int) -> np.ndarray:
        """The last decode's first ``rows`` output rows, a view where llama.cpp left them. Views are kept by the
        buffer's address and the row count (a row count's view is valid wherever a decode gave that many rows at that
        address): numpy's ctypes bridge (np.ctypeslib.as_array) built its array types anew each call, 0.07 ms of a
        step's 1.3 beside the forward (Qwen 1.5B, auto, one request, this 2-core CPU)."""
        address = self._logits_at(ctx)
        view = self._views.get((address, rows))
        if view is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            buffer = (ctypes.c_float * (rows * self.vocab_size)).from_address(address)
            view = self._views[address, rows] = np.frombuffer(buffer, dtype=np.float32).reshape(rows, self.vocab_size)
        return view

    def _ensure_batch(self, n_tokens: int) -> None:
        if n_tokens > self.n_batch:
            raise LlamaCppError(f"a forward of {n_tokens} tokens exceeds the batch size {self.n_batch}; "
                                "prefill in chunks (max_forward_tokens)")
        if self._batch is not None and n_tokens <= self._batch_cap:
            return
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
        self._batch_cap = min(max(n_tokens, 2 * self._batch_cap, 64), self.n_batch)
        self._batch = self._lib.llama_batch_init(self._batch_cap, 0, 1)

    def _copy_stream(self, src: int, dst: int) -> None:
        """Make slot ``dst`` a copy of slot ``src`` (the whole stream, same cell layout). llama.cpp copies the
        stream's data at the next decode of this context: until then ``dst`` is stale to a state read."""
        self._lib.llama_memory_seq_rm(self._mem, dst, -1, -1)
        self._lib.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._stale.add(dst)

    # ---- slots, sharing and eviction -------------------------------------------------

    def _get(self, seq_id: Hashable, pinned: set) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _Seq(self._take_slot(pinned | {seq_id}))
        self._seqs.move_to_end(seq_id)
        self._settle(s)
        return s

    def _take_slot(self, pinned: set) -> int:
        """The lowest slot no live sequence holds. llama.cpp splits a batch over several KV streams into ubatches
        of adjacent slots only (llama_batch_allocr::split_equal, sequential), each reading every weight: 12
        one-token rows on slots 0..11 are one ubatch, on slots 0..5 and 20..25 two. So live sequences are kept on
        the low slots, side by side, and kept prompt-cache streams on the high ones (release). When slots run short the
        least recently kept stream goes first, wherever it lies, and a kept stream below the lowest free slot moves
        up into that one: the new sequence takes the slot next to the live ones (with a full prompt cache, taking
        the least recently kept stream's slot scattered the live sequences: 16 requests in a closed loop ran 2.9
        ubatches a step, 444 ms against 283 on slots side by side, Qwen 1.5B on a 2-core Xeon)."""
        while not self._free:
            if self._kept:  # the prompt cache gives up its least recently kept stream first
                self._free_slot(self._kept.popitem(last=False)[0])
            elif not self._evict_one(pinned):  # an evicted sequence may go to the prompt cache: the loop frees it
                raise LlamaCppError(f"a forward needs more than {self.slots} sequences and tree branches; "
                                    "raise the runner's slots")
        slot = min(self._free)
        below = [k for k in self._kept if k < slot]
        if below:  # the lowest open slot holds a kept stream: it moves up, out of the live run
            low = min(below)
            self._move_stream(low, slot)
            self._kept = OrderedDict((slot if k == low else k, ids) for k, ids in self._kept.items())
            slot = low
        self._free.remove(slot)
        return slot

    def _room_above(self, slot: int) -> int | None:
        """Where a stream released from ``slot`` is kept, out of the live sequences' run: the highest free slot
        above it, else the slot of the least recently kept stream above it (that stream dropped), else None (it
        stays: nothing lies above it)."""
        top = max(self._free, default=-1)
        if top > slot:
            return top
        above = next((k for k in self._kept if k > slot), None)  # least recently kept first
        if above is None:
            return None
        del self._kept[above]
        self._free_slot(above)
        return above

    def _pack(self) -> None:
        """Move live sequences down into free slots below them, highest first, so they stay side by side on the
        low slots (_take_slot) as requests finish in any order: two one-token rows on slots 1 and 3 are two
        ubatches, 147-153 ms a step for Qwen 1.5B on a 2-core Xeon, against 102 ms on slots 0 and 1. A move
        copies the whole stream (tens of MB: a few ms, once), against that much every later step. Only between
        forwards: a forward places its tokens by slot as it goes."""
        for s in sorted(self._seqs.values(), key=lambda s: s.slot, reverse=True):
            low = min(self._free, default=None)
            if low is None or low > s.slot:
                return
            if s.tree is not None:  # its branches hold slots of their own until compact: leave it
                continue
            s.slot = self._move_stream(s.slot, low)

    def _move_stream(self, src: int, dst: int) -> int:
        """Move slot ``src``'s stream to the free slot ``dst``, freeing ``src``; returns ``dst``."""
        self._free.remove(dst)
        self._copy_stream(src, dst)
        self._free_slot(src)
        return dst

    def _free_slot(self, slot: int) -> None:
        self._lib.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._free.append(slot)

    def _trim(self, s: _Seq, keep: int) -> None:
        self._lib.llama_memory_seq_rm(self._mem, s.slot, keep, -1)
        del s.tokens[keep:]
        s.blocked = min(s.blocked, keep // BLOCK * BLOCK)

    def _borrow(self, s: _Seq, token_ids: list[int], cap: int) -> int:
        """Copy the stream sharing the longest prefix with ``token_ids``, among the live sequences and the prompt
        cache (a kept stream stays kept: requests that arrive together all take the same system prompt); its
        length."""
        best, donor = 0, None  # donor: (slot, the ids it holds)
        live = [(o.slot, o.tokens, o.blocked) for o in self._seqs.values() if o is not s and o.tree is None]
        for slot, ids, blocked in live + [(slot, ids, 0) for slot, ids in self._kept.items()]:
            n = _common_prefix(ids, token_ids)
            if self.exact:  # only whole blocks computed as this sequence's prefill computes them (measured on
                # Qwen 1.5B Q4_K_M: a prompt's last row moved by 0.37 after a borrow that ended mid-block)
                n = min(n, blocked) // BLOCK * BLOCK
            if n > best:
                best, donor = n, (slot, ids)
        best = min(best, cap) // BLOCK * BLOCK if self.exact else min(best, cap)
        if donor is None or best < MIN_BORROW:
            return 0
        slot, ids = donor
        if slot in self._kept:
            self._kept.move_to_end(slot)
        self._copy_stream(slot, s.slot)
        s.tokens, s.blocked = list(ids), best if self.exact else 0
        self._trim(s, best)
        self.stats.reused_tokens += best
        return best

    def _evict_one(self, pinned: set) -> bool:
        for seq_id, s in self._seqs.items():
            if seq_id not in pinned and s.tree is None:
                self._release(seq_id)
                self.evictions += 1
                return True
        return False

    def close(self) -> None:
        lib = self._lib
        if getattr(self, "_plain", None) is not None:
            self._plain.close()
            self._plain = None
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass


def _shared_prefix(cov) -> int:
    """Leading tokens of a tree input that lie on every branch (the committed suffix)."""
    on_all = cov.member.all(axis=1)
    return len(on_all) if on_all.all() else int(np.argmin(on_all))


def _segments(run: range, positions: list[int]) -> list[list[int]]:
    """Cut a run at multiples of BLOCK: a whole block stays one segment, the rest in EXACT_ROWS pieces."""
    out, i = [], 0
    while i < len(run):
        j = i
        while j < len(run) and positions[j] // BLOCK == positions[i] // BLOCK:
            j += 1
        block = list(run[i:j])
        if len(block) == BLOCK:
            out.append(block)
        else:
            out += [block[k:k + EXACT_ROWS] for k in range(0, len(block), EXACT_ROWS)]
        i = j
    return out


def _cells_per_slot(kv_budget_bytes: int | None, slots: int, cell_bytes: int, train_ctx: int) -> int:
    per_slot = DEFAULT_CELLS_PER_SLOT if kv_budget_bytes is None else kv_budget_bytes // (slots * cell_bytes)
    return int(max(256, min(per_slot, train_ctx)))


def slot_cells(cfg, kv_budget_bytes: int | None, slots: int = DEFAULT_SLOTS) -> int:
    """The longest sequence a runner of ``cfg`` (a ModelConfig) holds: what the router admits."""
    cell_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, f16
    return _cells_per_slot(kv_budget_bytes, slots, cell_bytes, cfg.max_position)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a[:n] == b[:n]:  # the usual case, a cache behind its ids: one C-level compare, no arrays
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _top1_nll(row: np.ndarray) -> tuple[int, float]:
    """A logits row's argmax and that token's NLL under the softmax, -log p(top) = log sum exp(row - max)."""
    top = int(row.argmax())
    return top, float(np.log(np.exp(row - row[top]).sum(dtype=np.float64)))
