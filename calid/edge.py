"""Collaborative edge drafting: the client runs the draft model, the gateway filters and verifies.

A round is what a client sends after each server reply (calid.v1 DraftRound):
  tokens      its draft, drafted after every id the server has committed so far;
  confidence  the draft's top-1 probability at each token (CALID's confidence);
  rows        sampled speculative only: the distribution each token was drawn from, as a
              sparse row (ids, probs) that is zero elsewhere.

The server checks a round (``check_round``: the client is not trusted to be well-formed) and turns
it into the DraftResult the orchestrator takes from its own draft worker (``round_draft``):
  filter       the longest prefix whose confidence clears the threshold is accepted at once
               (early acceptance); if the round has more, or is empty, the target generates the
               next token after that prefix;
  speculative  the whole round goes to the target's lossless verification, with the client's
               rows as the draft distribution q.
Speculative sampling stays exact with a truncated draft: it needs only that each draft token was
drawn from the q the verifier sees, so the SDK draws from the top EDGE_TOP_K of its warped
distribution, renormalized, and sends exactly that row.

``EdgeDrafter`` is the client's side: it drafts one round with a local model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

import torch

from calid.decoding.confidence import top1
from calid.decoding.sampling import Warp, warp
from calid.errors import InvalidRequestError
from calid.runtime.runner import SeqInput
from calid.workers.messages import DraftResult

EDGE_MODES = ("filter", "speculative")
MAX_ROW = 256  # ids in one sparse row
EDGE_TOP_K = 64  # the SDK's sampled drafts come from the top 64 of the warped draft distribution
ROW_SUM_TOLERANCE = 1e-3


@dataclass
class EdgeRound:
    tokens: list[int]
    confidence: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float]]] = field(default_factory=list)  # (ids, probs) per token


def check_round(r: EdgeRound, *, mode: str, vocab_size: int, max_draft: int, sampled: bool) -> None:
    """Raise InvalidRequestError naming what is wrong with a client's round."""
    if len(r.tokens) > max_draft:
        raise InvalidRequestError(f"round carries {len(r.tokens)} draft tokens; the server allowed at most {max_draft}")
    bad = [t for t in r.tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"draft token {bad[0]} is outside the vocabulary (size {vocab_size})")
    if mode == "filter":
        if len(r.confidence) != len(r.tokens):
            raise InvalidRequestError(f"filter rounds need one confidence per token: {len(r.tokens)} tokens, "
                                      f"{len(r.confidence)} confidences")
        if any(not (0.0 <= c <= 1.0) for c in r.confidence):  # NaN fails both comparisons
            raise InvalidRequestError("confidences must be probabilities in [0, 1] (no NaN)")
    if mode == "speculative" and sampled:
        if len(r.rows) != len(r.tokens):
            raise InvalidRequestError(f"sampled speculative rounds need the draft distribution of every token: "
                                      f"{len(r.tokens)} tokens, {len(r.rows)} rows")
        for i, (token, (ids, probs)) in enumerate(zip(r.tokens, r.rows)):
            _check_row(i, token, ids, probs, vocab_size)


def _check_row(i: int, token: int, ids: list[int], probs: list[float], vocab_size: int) -> None:
    where = f"rows[{i}]"
    if not 1 <= len(ids) <= MAX_ROW or len(ids) != len(probs):
        raise InvalidRequestError(f"{where} must pair 1..{MAX_ROW} ids with as many probabilities")
    if len(set(ids)) != len(ids) or any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{where} ids must be distinct token ids of the vocabulary")
    if any(not (0.0 <= p <= 1.0) for p in probs) or abs(math.fsum(probs) - 1.0) > ROW_SUM_TOLERANCE:
        raise InvalidRequestError(f"{where} must be a probability distribution (each in [0, 1], summing to 1)")
    if token not in ids or probs[ids.index(token)] <= 0.0:
        raise InvalidRequestError(f"{where} gives its draft token {token} no probability")


def confident_prefix(confidence: list[float], threshold: float) -> int:
    """How many leading tokens clear ``threshold`` (1.0 clears none: the target for every token)."""
    if threshold >= 1.0:
        return 0
    n = 0
    while n < len(confidence) and confidence[n] >= threshold:
        n += 1
    return n


def dense_rows(rows: list[tuple[list[int], list[float]]], vocab_size: int) -> torch.Tensor:
    """Sparse rows -> q [len(rows), V], each row renormalized to sum to exactly 1."""
    q = torch.zeros(len(rows), vocab_size, device="cpu")
    for i, (ids, probs) in enumerate(rows):
        p = torch.tensor(probs, dtype=torch.float32, device="cpu")
        q[i, torch.tensor(ids, dtype=torch.long, device="cpu")] = p / p.sum()
    return q


def round_draft(request_id: Hashable, r: EdgeRound, *, mode: str, threshold: float, vocab_size: int,
                sampled: bool) -> DraftResult:
    """The DraftResult a checked round stands for (see the module docstring)."""
    if mode == "filter":
        n = confident_prefix(r.confidence, threshold)
        early = n == len(r.tokens) and n > 0  # every token confident: no target call
        return DraftResult(request_id, r.tokens[:n], None, needs_target=not early)
    q = dense_rows(r.rows, vocab_size) if sampled and r.tokens else None
    return DraftResult(request_id, list(r.tokens), q, needs_target=True)


class EdgeDrafter:
    """Drafts rounds with a local model (a runner of calid.runtime: llama.cpp or torch).

    The runner keeps one KV cache per request and reuses its longest common prefix with the ids it
    is given, so rolling back past rejected draft tokens is free: the next round simply starts from
    the ids the server committed.
    """

    def __init__(self, runner, eos_ids: frozenset[int]):
        self.runner, self.eos_ids = runner, eos_ids

    def draft(self, request_id: Hashable, token_ids: list[int], *, mode: str, max_draft: int, threshold: float,
              warp_params: Warp, generator: torch.Generator | None = None) -> EdgeRound:
        """Up to ``max_draft`` tokens after ``token_ids``. filter: stops after the first token below the
        threshold (the server replaces it with the target's); speculative: the same dynamic length."""
        r = EdgeRound([])
        while len(r.tokens) < max_draft:
            ids = token_ids + r.tokens
            row = self.runner.forward([SeqInput(request_id, self.runner.sync(request_id, ids))])[0][-1]  # [V]
            confidence = math.exp(-float(top1(row[None])[1][0]))
            token = self._pick(row, r, warp_params, generator)
            r.tokens.append(token)
            r.confidence.append(min(1.0, confidence))
            if confident_prefix([confidence], threshold) == 0 or token in self.eos_ids:
                break
        return r

    @staticmethod
    def _pick(row: torch.Tensor, r: EdgeRound, w: Warp, generator: torch.Generator | None) -> int:
        if w.greedy:
            return int(row.argmax())
        probs = warp(row[None], w)[0]
        top = torch.topk(probs, min(EDGE_TOP_K, probs.shape[-1]))
        keep = top.values > 0
        p, ids = top.values[keep], top.indices[keep]
        p = p / p.sum()
        token = int(ids[torch.multinomial(p, 1, generator=generator)])
        r.rows.append((ids.tolist(), p.tolist()))
        return token

    def release(self, request_id: Hashable) -> None:
        self.runner.release(request_id)
