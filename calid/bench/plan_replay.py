"""What the planner's n-gram copies gain on given outputs, without the machine's noise (pure; no model).

``calid bench modes`` measures auto against ar on a shared 2-core machine whose speed drifts by 10-30% within
minutes, so a served ratio near 1.0 cannot say whether the planner chose badly or the machine slowed. This replays
a burst instead. The burst's greedy ar outputs go step by step through the planner (calid.planning.plan_steps),
with n-gram copies as the only drafts, proposed as auto proposes them (calid.decoding.ngram, from each request's
own tokens so far). Each step is timed by a cost table as the target splits the batch (calid.planning.split_cost).
Greedy verification keeps a copied token exactly where ar's output has it, so the replay's tokens are exact; only
its timing is modelled. It decodes only (a request's first token is its prefill's), so it compares with a served
run's decoding speed-up (decode_vs_ar), not with whole requests.

Left out: the StepGuard (it corrects forecasts by measured steps, which a replay has none of), draft models and
Lookahead (their proposals need the models), and live updates of the cost table.

With ``foresight`` the planner is told, before each step, exactly how many tokens of every copy ar's output
confirms (each copy's survival 1 up to there, 0 beyond), so it verifies no token that breaks and knows which
requests' copies are worth a long chain. That separates two losses: replay against foresight is what guessing a
copy's yield costs; foresight against the target is what no n-gram planner of this cost model can reach at this
load. It is the planner's own step-by-step choice, not an optimum over whole bursts, so it is a ceiling in
practice, not a proven one (at one request, calid.bench.ngram_bound is exact).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from calid.decoding.ngram import MAX_CHAIN, CopyHazard, CopyShare, NgramIndex
from calid.orchestrator import draft_budget
from calid.planning import Choice, CostTable, PlanInput, plan_steps, split_cost

Planner = Callable[[list[PlanInput], CostTable, bool], list[Choice]]


def auto_planner(inputs: list[PlanInput], verify: CostTable, sliced: bool) -> list[Choice]:
    """What auto's planner picks with no draft model."""
    return plan_steps(inputs, verify, CostTable(), sliced=sliced)


@dataclass(frozen=True)
class Replay:
    requests: int
    tokens: int  # output tokens decoded (each request's after its first)
    copied: int  # of them, accepted from copies
    steps: int  # the planner's steps
    verified: int  # copied tokens sent to the target, held or not
    ar_steps: int
    ar_s: float  # plain decoding's steps, timed by the table
    planned_s: float  # the planner's steps, timed by the table

    @property
    def ratio(self) -> float:
        """Plain decoding's time over the planner's (1.0 with nothing to decode)."""
        return self.ar_s / self.planned_s if self.planned_s > 0 else 1.0

    def describe(self) -> str:
        return (f"{self.ratio:.2f}x ar decoding ({self.copied}/{self.tokens} tokens copied, {self.steps} steps "
                f"against ar's {self.ar_steps})")

    def __add__(self, other: "Replay") -> "Replay":
        """Two bursts replayed one after the other (waves of a closed loop): their counts and times add up."""
        return Replay(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Replay)))


def replay_burst(
    prompts: list[list[int]],
    outputs: list[list[int]],
    verify: CostTable,
    max_new_tokens: int | None = None,
    sliced: bool = True,
    planner: Planner = auto_planner,
    foresight: bool = False,
    hazard: CopyHazard | None = None,
) -> Replay:
    """Decode ``prompts`` together (one burst, no request joins later) into their greedy ar ``outputs`` twice: in
    plain steps, and as ``planner`` chooses with n-gram copies. ``max_new_tokens``: each request's budget as the
    server knew it (its tokens left rank it in the planner's cost to go; default: its output's length); ``sliced``:
    the target splits a batch into slices (llama.cpp); ``foresight``: the planner knows each copy's yield (see
    the module's notes); ``hazard``: the server's learned copy hazards, carried from burst to burst as a server
    carries them (default: fresh, learning from this burst only)."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if not verify.known:
        raise ValueError("the cost table has no timings")
    budgets = [max_new_tokens or len(out) for out in outputs]
    if any(b < len(out) for b, out in zip(budgets, outputs)):
        raise ValueError(f"an output is longer than max_new_tokens={max_new_tokens}")
    ar_s, ar_steps = _plain(outputs, verify, sliced)
    produced = [min(1, len(out)) for out in outputs]  # the first token is the prefill's
    indexes = [NgramIndex() for _ in prompts]
    hazard = CopyHazard() if hazard is None else hazard
    shares = [CopyShare() for _ in prompts]
    planned_s, steps, copied, verified = 0.0, 0, 0, 0
    while active := [i for i, out in enumerate(outputs) if produced[i] < len(out)]:
        holds, inputs, copies = [], [], []  # per active request: how many of its copy's tokens ar's output confirms
        for i in active:
            indexes[i].extend(prompts[i] + outputs[i][: produced[i]])
            left = budgets[i] - produced[i]
            copy = indexes[i].copy(draft_budget("auto", MAX_CHAIN, left))
            held = _held(copy.tokens, outputs[i][produced[i]:])
            holds.append(held)
            copies.append(copy)
            request = PlanInput.of_copy(copy, hazard.survival(copy, shares[i].value), alpha=0.0, cap=0, remaining=left)
            if foresight:
                request = replace(request, ngram_survival=(1.0,) * held + (0.0,) * (len(copy.tokens) - held))
            inputs.append(request)
        lengths = []
        for i, held, copy, choice in zip(active, holds, copies, planner(inputs, verify, sliced)):
            drafted = choice.gamma if choice.mode == "ngram" else 0  # a prefix of the copy
            if drafted:
                hazard.observe(copy, shares[i].value, drafted, min(held, drafted))
            at = produced[i]
            produced[i] = min(len(outputs[i]), at + min(held, drafted) + 1)
            shares[i].update(copy.tokens, outputs[i][at: produced[i]])
            verified += drafted
            copied += produced[i] - at - 1
            lengths.append(1 + drafted)
        planned_s += _seconds(lengths, verify, sliced)
        steps += 1
    tokens = sum(max(0, len(out) - 1) for out in outputs)
    return Replay(len(prompts), tokens, copied, steps, verified, ar_steps, ar_s, planned_s)


def _held(copy: list[int], rest: list[int]) -> int:
    """How many of ``copy``'s first tokens ar's output ``rest`` confirms (the last output token is the
    target's own, never a copy's)."""
    held = 0
    while held < len(copy) and held < len(rest) - 1 and copy[held] == rest[held]:
        held += 1
    return held


def _plain(outputs: list[list[int]], verify: CostTable, sliced: bool) -> tuple[float, int]:
    """Seconds and steps of plain decoding: a step of every request not yet done, one token each."""
    left = sorted(max(0, len(out) - 1) for out in outputs)
    seconds, done = 0.0, 0
    for k, n in enumerate(left):  # the requests from k on are still decoding for n - done more steps
        seconds += (n - done) * _seconds([1] * (len(left) - k), verify, sliced)
        done = n
    return seconds, left[-1] if left else 0


def _seconds(lengths: list[int], verify: CostTable, sliced: bool) -> float:
    return split_cost(lengths, verify) if sliced else verify(sum(lengths))

