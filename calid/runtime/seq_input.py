"""What a forward takes (``SeqInput``, one sequence's new tokens) and what a runner counts (``RunnerStats``),
apart from the runners so that the pieces they share (calid.runtime.twins) need no runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch


@dataclass
class SeqInput:
    """New tokens of one sequence for one forward.

    ``positions`` default to consecutive positions after the cache; ``ancestors``
    is a [q, q] bool mask among the new tokens (token trees), default causal;
    ``logits_at`` indexes the new tokens whose logits are returned (default: last).
    ``reads``: what the caller reads of those rows. "rows": all of them. "top1": each one's argmax only (a greedy
    verdict), and "top1_nll": its argmax and that token's NLL under the softmax (a greedy draft's confidence):
    then a runner may answer with a list of len(logits_at) argmax ids, or of (id, NLL) pairs, instead of the
    [len(logits_at), V] rows (llama.cpp does: no row of the vocabulary's width leaves it). A runner may always
    answer with the rows (calid.decoding.sampling.argmax_rows takes either). ``expect`` (with "top1"): the token
    each row is checked against, a greedy chain's draft (row i's argmax against expect[i]; a row past its end is
    checked against nothing): a runner may stop reading rows after the first whose argmax is not its expected
    token and answer with the ids up to and including that row, all a greedy verdict reads.
    """

    seq_id: Hashable
    tokens: list[int]
    positions: list[int] | None = None
    ancestors: torch.Tensor | None = None
    logits_at: list[int] | None = None
    reads: str = "rows"  # rows | top1 | top1_nll
    expect: list[int] | None = None
    # tokens a runner that splits a batch into slices may feed after a chain's own (never returning their logits,
    # dropping their cells after the forward) so that the batch's sequences run as one slice (calid.planning:
    # batch_level); other runners ignore it
    pad: int = 0


@dataclass
class RunnerStats:
    forwards: int = 0
    tokens: int = 0
    recomputed_tokens: int = 0  # tokens fed again after a cache miss or eviction
    reused_tokens: int = 0  # prompt tokens taken over from another sequence's cache instead of computed
    forked_sequences: int = 0  # sequences whose prefill was another's, forked after the forward (calid.runtime.twins)
    plain_prefill_tokens: int = 0  # llama.cpp: prompt tokens fed to the unrepacked weights (plain_prefill)
    padded_tokens: int = 0  # SeqInput.pad tokens fed to even a batch (in ``tokens`` too; their cells dropped)
    ubatches: int = 0  # llama.cpp: the ubatches its forwards ran as, each reading every weight (llamacpp.ubatches)
    forward_s: float = 0.0  # seconds inside the model's own forward (llama_decode; the torch model's call): a step's
    # time less this is what calid adds around the forward (calid bench modes prints it)
