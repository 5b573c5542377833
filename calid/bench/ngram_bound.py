"""The most n-gram drafts can gain on given outputs at given verification costs (pure; no model).

auto takes an n-gram chain (calid.decoding.ngram) where the planner expects it to pay, from running estimates
of how much of a chain the target accepts. A planner that knew, before verifying, how many tokens of each
proposal the target will accept would verify exactly the prefix that pays best and never a rejected token; no
planner of n-gram drafts does better. Greedy verification accepts a proposed token exactly when it is the
token ar picks next, so replaying each request's greedy ar output through the request's own n-gram index
gives that bound exactly:

  at each position, the index proposes a chain (at most ``cap`` tokens, leaving the last output token to the
  target); of its ``a`` tokens that ar's output confirms, the oracle verifies the prefix of ``g <= a`` tokens
  maximising (g + 1) / cost(g + 1), where cost(k) is one forward of k tokens (g = 0: a plain step);
  bound = (tokens x cost(1)) / the sum of those forwards' costs.

At one request at a time: the costs are one request's forwards. Under load a plain step already carries many
requests, so drafting gains less.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from calid.decoding.ngram import MAX_CHAIN, NgramConfig, NgramIndex


@dataclass(frozen=True)
class NgramBound:
    tokens: int  # output tokens replayed
    copied: int  # of them, taken from n-gram proposals by the oracle
    ar_s: float  # plain decoding: tokens x cost(1)
    oracle_s: float  # the oracle's forwards

    @property
    def ratio(self) -> float:
        """The oracle's speedup over plain decoding (1.0 with no tokens)."""
        return self.ar_s / self.oracle_s if self.oracle_s > 0 else 1.0


def ngram_bound(prompts: list[list[int]], outputs: list[list[int]], cost: Callable[[int], float],
                cap: int = MAX_CHAIN, config: NgramConfig = NgramConfig()) -> NgramBound:
    """The oracle's bound over requests ``prompts[i]`` whose greedy ar output was ``outputs[i]``; ``cost(k)``:
    seconds of one forward of ``k`` tokens of one request."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    step = cost(1)
    if step <= 0:
        raise ValueError("cost(1) must be positive")
    best = _best_prefix(cost, cap)
    tokens = copied = 0
    oracle = 0.0
    for prompt, out in zip(prompts, outputs):
        index, at = NgramIndex(config), 0
        while at < len(out):
            index.extend(prompt + out[:at])
            chain = index.propose(min(cap, len(out) - at - 1))
            agreed = 0
            while agreed < len(chain) and chain[agreed] == out[at + agreed]:
                agreed += 1
            g = best[agreed]
            oracle += cost(g + 1)
            copied += g
            at += g + 1
        tokens += len(out)
    return NgramBound(tokens, copied, tokens * step, oracle)


def _best_prefix(cost: Callable[[int], float], cap: int) -> list[int]:
    """For each count of confirmed tokens a in [0, cap], the prefix g <= a that yields most tokens per second
    (the shorter one on a tie)."""
    out, g = [0], 0
    for a in range(1, cap + 1):
        if (a + 1) / cost(a + 1) > (g + 1) / cost(g + 1):
            g = a
        out.append(g)
    return out


def ngram_share(tokenizer, outcomes: list) -> float | str:
    """The share of the output tokens that an n-gram proposal from the request's own text (its chat prompt and
    output so far, calid.decoding.ngram) would have predicted: what copying drafts can find in these outputs,
    before any cost. ``outcomes``: calid.placement.traffic.Outcome with the user's message and the answer's text.
    "-": no tokenizer, or no chat request with text."""
    from calid.text import encode_prompt

    done = [o for o in outcomes if o.prompt and o.text] if tokenizer is not None else []
    if not done:
        return "-"
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": o.prompt}]) for o in done]
    outputs = [tokenizer(o.text, add_special_tokens=False).input_ids for o in done]
    bound = ngram_bound(prompts, outputs, lambda k: 1.0)  # verification free: every confirmed copy counts
    return bound.copied / bound.tokens if bound.tokens else "-"
