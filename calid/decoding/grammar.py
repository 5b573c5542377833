"""Structured output: a grammar says which tokens may come next, in every decoding mode.

A request may carry a ``Grammar`` (a JSON schema, any JSON object, a regex or a
Lark grammar), compiled and checked at the edge by llguidance. Each worker
keeps one grammar cursor per request (``GrammarMasks``): soft state, like its
KV cache, rebuilt from the request's output ids wherever the request lands.
A cursor moves to any prefix of the output (roll back to the common prefix,
consume the rest), so one cursor serves a draft chain, every lane of a token
tree and the target's rows at every drafted position.

Masking a row sets the logits of the tokens the grammar forbids after that
row's prefix to -inf, and everything downstream is the unconstrained code on
masked rows: the draft proposes only allowed tokens (its confidence is over
the allowed ones), the target verifies with its masked distribution, so
greedy lossless modes equal ``ar`` under the same grammar and sampled ones keep
the target's masked distribution. A row whose prefix already breaks the grammar
(an n-gram or Lookahead proposal the target will reject before reaching it) is
left as it is. Once the grammar is complete only the end-of-sequence tokens stay
allowed.

Why llguidance: masks in tens to hundreds of microseconds a token on one CPU
core (a 152k vocabulary, JSON schemas), rollback of consumed tokens (what
speculation needs), a plain CPU wheel with no torch or compiler dependency, and
JSON schema, regex and Lark from one engine.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from calid.errors import InvalidRequestError

_BUILT: dict[tuple, object] = {}  # llguidance tokenizers of this process, by vocabulary
_BUILD_LOCK = threading.Lock()
KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_SOURCE_CHARS = 100_000
# JSON on one line, laid out as json.dumps does: free whitespace lets a confident draft (filter) pad for ever
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: ``kind`` and ``source`` as the user gave them, ``spec`` llguidance's grammar."""

    kind: str
    source: str
    spec: str

    @classmethod
    def compile(cls, kind: str, source: str = "") -> "Grammar":
        """Check and compile; raises InvalidRequestError naming the problem."""
        from llguidance import LLMatcher

        if kind not in KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if len(source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(f"{kind} is {len(source)} characters, over the limit of {MAX_SOURCE_CHARS}")
        if kind in ("json_schema", "json_object"):
            try:
                schema = json.loads(source) if kind == "json_schema" else {"type": "object"}
            except ValueError as exc:
                raise InvalidRequestError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("json_schema must be a JSON object (a schema)")
            try:
                spec = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            except ValueError as exc:
                raise InvalidRequestError(f"json_schema: {exc}") from None
        elif not source:
            raise InvalidRequestError(f"{kind} is empty")
        else:
            spec = (LLMatcher.grammar_from_regex if kind == "regex" else LLMatcher.grammar_from_lark)(source)
        error = LLMatcher.validate_grammar(spec)
        if error:  # llguidance's message on one line, without its caret lines
            words = " ".join(w.strip() for w in error.splitlines() if w.strip().strip("^"))
            raise InvalidRequestError(f"invalid {kind.replace('_', ' ')}: {words[:400]}")
        return cls(kind, source, spec)


class _Cursor:
    """An llguidance matcher and the output ids it has consumed."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.ids: list[int] = []

    def move(self, prefix: list[int]) -> bool:
        """Roll back to the longest common prefix with ``prefix`` and consume the rest; False (the cursor at
        the longest allowed part) when ``prefix`` breaks the grammar."""
        m, k = self.matcher, _common_prefix(self.ids, prefix)
        if k < len(self.ids):
            m.rollback(len(self.ids) - k)
            del self.ids[k:]
        rest = prefix[k:]
        ok = m.validate_tokens(rest) if rest else 0
        if ok:
            m.consume_tokens(rest[:ok])
            self.ids += rest[:ok]
        return ok == len(rest) and not m.is_error()


class GrammarTokens:
    """A model's vocabulary as llguidance sees it (token bytes, end-of-sequence ids, ``vocab_size`` the logits'
    width). Built on first use (a few seconds over a 150k vocabulary: the first constrained request waits for
    it), then shared by the workers of a process, each with its own cursors (``masks``)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.vocab_size = vocab_size
        self._tokenizer, self._eos = tokenizer, sorted(eos_ids)
        self._llt = None

    def get(self):
        with _BUILD_LOCK:
            if self._llt is None:
                import llguidance.hf

                try:  # the draft and the target of a pair share a vocabulary: built once per process
                    key = (hash(self._tokenizer.backend_tokenizer.to_str()), self.vocab_size, tuple(self._eos))
                    if key not in _BUILT:
                        _BUILT[key] = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self._eos)
                    self._llt = _BUILT[key]
                except Exception as exc:
                    raise RuntimeError(f"structured output is unavailable for this tokenizer: {exc}") from exc
            return self._llt

    def masks(self) -> "GrammarMasks":
        return GrammarMasks(self)


class GrammarMasks:
    """One worker's grammar cursors, one per request (a worker's calls run one at a time: not thread-safe)."""

    def __init__(self, tokens: GrammarTokens):
        self.tokens = tokens
        self._cursors: dict[Hashable, tuple[Grammar, _Cursor]] = {}
        self.rows = 0  # rows masked so far, and the seconds it took (moving the cursor, the mask, applying it)
        self.seconds = 0.0

    def _cursor(self, key: Hashable, grammar: Grammar) -> _Cursor:
        held = self._cursors.get(key)
        if held is not None and held[0] == grammar:
            return held[1]
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokens.get(), grammar.spec, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {grammar.kind}: {matcher.get_error()}")
        cursor = _Cursor(matcher)
        self._cursors[key] = (grammar, cursor)
        return cursor

    def apply(self, rows: torch.Tensor, entries: list[tuple[Hashable, Grammar, list[int]] | None]) -> torch.Tensor:
        """``rows`` [n, V] with row i masked to what its entry's grammar allows after the entry's output ids
        (entry ``(request key, grammar, output ids)``; None, or ids that break the grammar: the row as it is).
        A new tensor; ``rows`` is not written."""
        out = rows.clone()
        for i, entry in enumerate(entries):
            if entry is None:
                continue
            start = time.perf_counter()
            key, grammar, prefix = entry
            cursor = self._cursor(key, grammar)
            if cursor.move(prefix):
                out[i].masked_fill_(self._forbidden(cursor.matcher, out.shape[-1]).to(out.device), float("-inf"))
            self.rows += 1
            self.seconds += time.perf_counter() - start
        return out

    @staticmethod
    def _forbidden(matcher, width: int) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        if len(bits) < width:
            bits = np.concatenate([bits, np.zeros(width - len(bits), np.uint8)])
        return torch.from_numpy(bits[:width] == 0)

    def release(self, key: Hashable) -> None:
        self._cursors.pop(key, None)

    def __len__(self) -> int:
        return len(self._cursors)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (list comparisons run in C; a binary search over them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def constrain(masks: GrammarMasks | None, rows: torch.Tensor,
              entries: list[tuple[Hashable, Grammar, list[int]] | None]) -> torch.Tensor:
    """``GrammarMasks.apply`` when any entry has a grammar, else ``rows`` untouched (no cost for the rest)."""
    if not any(entries):
        return rows
    if masks is None:
        raise RuntimeError("structured output is unavailable: this worker was built without a tokenizer")
    return masks.apply(rows, entries)
