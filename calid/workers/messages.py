"""Plain-data calls between the orchestrator (calid.orchestrator) and its model workers.

One decoding step of a request is two calls:

  DraftTask  -> draft worker  -> DraftResult   the draft chain (or token tree)
  VerifyTask -> target worker -> VerifyResult  the tokens to append

The orchestrator owns the request: its token ids are the source of truth and
every task carries them (in full, or over Ray as a delta from ``ids_from``
against the ids the replica acknowledged; serve_app.router.calls), so a worker holds
only soft state (KV caches keyed by request id, the Lookahead trie) and any
worker can serve any task, recomputing on a cache miss. A sampled request's random generator state
travels with its tasks for the same reason. The same messages cross a Ray
Serve handle unchanged (serve_app) or a plain function call (calid.Engine).
"""
from __future__ import annotations

import hashlib

from dataclasses import dataclass
from typing import Hashable

import torch

from calid.decoding.modes import DecodeParams
from calid.decoding.sampling import Warp
from calid.decoding.tree import TokenTree


@dataclass
class DraftTask:
    request_id: Hashable
    token_ids: list[int]  # committed ids: prompt + output so far
    decode: DecodeParams
    warp: Warp
    confidence_nll: float  # a draft step is confident when its top-1 NLL <= this
    budget: int  # most draft tokens worth proposing now (0: draft nothing)
    rng: torch.Tensor | None = None  # generator state of a sampled request
    ids_from: int = 0  # token_ids holds the committed ids from this position on (0: all of them)
    prompt_len: int = 0  # how many of token_ids are the prompt (a grammar constrains the ids after them)


@dataclass
class DraftResult:
    request_id: Hashable
    tokens: list[int]  # the draft chain (empty for a tree)
    q: torch.Tensor | None  # [len(tokens), V] warped draft rows; None when greedy (one-hot)
    needs_target: bool  # filter: False when every draft token was confident (early acceptance, unless others verify)
    tree: TokenTree | None = None  # tree mode
    forwards: int = 0  # draft forwards this request took part in
    rng: torch.Tensor | None = None
    probs: list[float] | None = None  # chain modes: the draft's top-1 probability at each of ``tokens``
    unsure: list[int] | None = None  # filter: indices of ``tokens`` the draft was unsure of (the target decides)
    catching_up: bool = False  # the draft only fed (or queued) part of the sequence this step: no draft yet


@dataclass
class VerifyTask:
    request_id: Hashable
    token_ids: list[int]  # committed ids
    prompt_len: int  # lookahead: how many of token_ids are the prompt
    decode: DecodeParams
    warp: Warp
    budget: int  # lookahead: most tree nodes worth proposing
    draft: list[int]  # chain modes: the draft tokens to verify
    q: torch.Tensor | None = None
    tree: TokenTree | None = None  # tree mode; lookahead trees come from the worker's trie
    rng: torch.Tensor | None = None
    ids_from: int = 0  # as DraftTask.ids_from
    audit_from: int | None = None  # filter: compare the target's top-1 with each id from this position on
    # filter: indices of ``draft`` the target decides (its token there; where it differs from the draft's, the draft
    # tokens after it are dropped). After the last draft token the target adds one of its own
    unsure: tuple[int, ...] = ()
    # a run of plain steps (ar, no draft): the target feeds each token it picks and picks the next, up to ``steps``
    # tokens or one of ``stop_ids``, in one call (calid.orchestrator.Orchestrator.lengthen_plain_steps)
    steps: int = 1
    stop_ids: frozenset[int] = frozenset()
    # the step's chains are padded up to this many tokens each where they are shorter (SeqInput.pad; 0: none), so
    # that a batch of mixed lengths runs as one slice (calid.planning.batch_level)
    level: int = 0

    @property
    def fed(self) -> int:
        """Tokens of this task's sequence in a decode step's forward: its draft and the target's one, padded to the
        level."""
        return max(1 + len(self.draft), self.level)


@dataclass
class VerifyResult:
    request_id: Hashable
    tokens: list[int]  # accepted draft tokens, then the target's next token
    accepted: int  # how many of ``tokens`` came from the draft
    proposed: int  # draft tokens offered (chain length, or tree depth)
    verifying: bool  # the target judged draft tokens (False for ar, and for filter with no unsure token)
    rng: torch.Tensor | None = None
    top1: int | None = None  # chain modes: the target's top-1 where it chose its next token
    audit_from: int = 0  # the position of audit[0]
    audit: list[bool] | None = None  # per id from audit_from on (committed, then draft): it is the target's top-1
    forwards: int = 1  # target forwards it took (a run of plain steps takes one per token)
    decided: tuple[int, ...] = ()  # filter: indices of accepted draft tokens the target decided (it picked the same)


@dataclass
class ScoreTask:
    """Log-probabilities of ``token_ids[start:]`` under the model, each given the ids before it
    (OpenAI's logprobs and echo). ``top_k``: also the ``top_k`` most likely tokens at each position."""

    request_id: Hashable
    token_ids: list[int]
    start: int  # >= 1: the first position scored (the first id has no context to score it by)
    top_k: int = 0


@dataclass
class ScoreResult:
    request_id: Hashable
    logprobs: list[float]  # one per scored position
    top: list[list[tuple[int, float]]]  # per position, the top_k (token id, log-probability), most likely first


def grammar_entry(t: DraftTask | VerifyTask, extra: list[int]) -> tuple | None:
    """What ``calid.decoding.grammar.constrain`` needs of task ``t`` for the row after its committed ids and
    ``extra`` (None: the request has no grammar)."""
    g = t.warp.grammar
    return None if g is None else (t.request_id, g, t.token_ids[t.prompt_len:] + extra)


def load_generator(state: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on ``device`` that continues the stream ``state`` describes.

    The state travels with the request between router and workers. A state of another device kind
    (a CPU draft and a CUDA target take turns) cannot be loaded as it is; the generator then continues
    from a seed derived from it, so sampled output stays a pure function of the seed and the placement.
    """
    if state is None:
        return None
    g = torch.Generator(device=device)
    try:
        g.set_state(state)
    except RuntimeError:  # the state of another device's generator (a different algorithm)
        digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest()
        g.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return g


def save_generator(g: torch.Generator | None) -> torch.Tensor | None:
    return None if g is None else g.get_state()


def require_full_ids(tasks: list) -> None:
    """Workers compute on full token ids: a delta (``ids_from``) must have been expanded by whoever holds the
    head (serve_app.workers.deployments); failing here beats decoding from a truncated context."""
    for t in tasks:
        if t.ids_from:
            raise ValueError(f"request {t.request_id!r}: token ids from position {t.ids_from} only reached the "
                             "worker (a delta nobody expanded)")
