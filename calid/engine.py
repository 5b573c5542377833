"""calid.Engine: the decoding loop in one process, for every mode.

Each step, for all active requests together (calid.orchestrator):
  1. draft   the draft worker extends each request that uses it, one token per
             batched forward, until the request's confidence test fails or its
             gamma cap is hit (dynamic draft length), or grows its token tree;
  2. verify  one batched target forward over every request that needs the
             target: its not-yet-cached committed tokens plus its pending
             draft (chain, or tree under a tree mask), with the logits the
             acceptance rule needs;
  3. accept  the request's acceptance rule (filter / rollback / speculative /
             tree verification) keeps a prefix of the draft and supplies the
             next token;
  4. append  token ids are the source of truth; both models' KV caches are
             soft state that the next ``sync`` rolls back to the committed ids.
Mode ``ar`` is the same loop with no draft: the target supplies every token.
Filter requests whose drafts were all confident skip step 2 entirely (early
acceptance); the target catches up on those tokens the next time it runs.
The Serve router (serve_app) runs the same orchestrator against remote workers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from calid.decoding.lookahead import LookaheadConfig
from calid.decoding.grammar import GrammarTokens
from calid.decoding.modes import DecodeParams
from calid.generation import GenerationRequest, GenerationResult, RequestState, StreamEvent
from calid.orchestrator import DraftCall, EngineConfigError, Orchestrator, VerifyCall, advance
from calid.runtime.runner import ModelRunner
from calid.workers import DraftWorker, TargetWorker

__all__ = ["Engine", "EngineConfigError", "StepTimes"]


@dataclass
class StepTimes:
    """Where the engine's decoding steps went, cumulative since it was built (plain data: a reader takes deltas).
    The models' own forward time is in each runner's ``stats.forward_s`` (``Engine.forward_s``); a step's time less
    that is what calid adds around the forwards: planning, the runners' work on logits, sampling, bookkeeping."""

    steps: int = 0
    step_s: float = 0.0  # whole steps: planning to the target's results appended
    plan_s: float = 0.0  # of which the planner's (what each request asks of the draft: Orchestrator.draft_tasks)


class Engine:
    def __init__(self, target: ModelRunner, tokenizer, eos_ids: frozenset[int], draft: ModelRunner | None = None,
                 max_batch: int = 8, default_decode: DecodeParams | None = None,
                 lookahead: LookaheadConfig | None = None, shared_trie: bool = True,
                 extra_drafts: list[ModelRunner] | tuple = (), max_forward_tokens: int | None = None):
        for d in [draft, *extra_drafts]:
            if d is not None and d.vocab_size != target.vocab_size:
                raise EngineConfigError(
                    f"draft and target have different vocabularies ({d.vocab_size} vs {target.vocab_size} tokens); "
                    "a draft must share the target's tokenizer"
                )
        if extra_drafts and draft is None:
            raise EngineConfigError("extra drafters merge into the main draft's trees; give a main draft first")
        self.target, self.draft = target, draft
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.max_batch = max_batch
        self.max_position = target.max_position
        self.orchestrator = Orchestrator(tokenizer, eos_ids, self.max_position, draft is not None, default_decode)
        self.orchestrator.sliced = getattr(target, "backend", None) == "llamacpp"  # see Orchestrator
        self.orchestrator.padding = not getattr(target, "exact", False)  # exact: fed exactly as given
        tokens = GrammarTokens(tokenizer, target.vocab_size, eos_ids)  # structured output, built on first use
        self.verifier = TargetWorker(target, lookahead, shared_trie, max_forward_tokens, tokens.masks())
        self.drafter = (DraftWorker(draft, eos_ids, extra_drafts, max_forward_tokens, tokens.masks())
                        if draft is not None else None)
        self._calibrated = False  # auto mode: forward costs measured once, on first use
        self.times = StepTimes()
        self._runners = [r for r in (target, draft, *extra_drafts) if r is not None]

    @classmethod
    def from_loaded(cls, target, draft=None, max_batch: int = 8, kv_budget_bytes: int | None = None,
                    lookahead: LookaheadConfig | None = None) -> "Engine":
        """Engine over LoadedModels (``calid.load_model``); refuses a draft with another tokenizer."""
        check_pair(target, draft)
        return cls(ModelRunner(target.model, kv_budget_bytes), target.tokenizer, target.eos_ids,
                   draft=ModelRunner(draft.model, kv_budget_bytes) if draft is not None else None, max_batch=max_batch,
                   lookahead=lookahead)

    @classmethod
    def from_models(cls, target, draft=None, max_batch: int = 8, **kw) -> "Engine":
        """Engine over opened models (``calid.open_model``: any backend); refuses a draft with another
        tokenizer."""
        if draft is not None:
            check_vocab(target, draft)
        return cls(target.runner, target.tokenizer, target.eos_ids, draft=draft.runner if draft else None,
                   max_batch=max_batch, **kw)

    @property
    def default_decode(self) -> DecodeParams:
        return self.orchestrator.default_decode

    # ---- public API -----------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = {}
        for event in self.stream(requests):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[r.request_id] for r in requests]

    def stream(self, requests: list[GenerationRequest]) -> Iterator[StreamEvent]:
        orch = self.orchestrator
        for req in requests:
            orch.validate(req)
        waiting = list(requests)
        try:
            while waiting or orch.active:
                while waiting and len(orch.active) < self.max_batch:
                    orch.start(waiting.pop(0))
                yield from self._step(list(orch.active.values()))
                self._release(orch.finished())
        finally:  # a consumer that stops early (client gone) frees every cache it held
            self._release([orch.finish(rid) for rid in list(orch.active)])

    def submit(self, req: GenerationRequest) -> None:
        """Admit one request now (step-level driving: submit, then call ``step`` repeatedly)."""
        self.orchestrator.start(self.orchestrator.validate(req))

    def step(self) -> list[StreamEvent]:
        """One decoding step over every submitted, unfinished request; finished ones are freed."""
        events = list(self._step(list(self.orchestrator.active.values())))
        self._release(self.orchestrator.finished())
        return events

    # ---- one step -------------------------------------------------------------

    def _step(self, states: list[RequestState]) -> Iterator[StreamEvent]:
        """Drive one step (Orchestrator.step) with the workers called in this process."""
        orch = self.orchestrator
        if not self._calibrated and any(s.req.decode.mode == "auto" for s in states):
            self.calibrate()
        step_start = time.perf_counter()
        step = orch.step(states)
        io = advance(step)
        while io is not None:
            if isinstance(io, DraftCall):
                self.times.plan_s += time.perf_counter() - step_start
                io = advance(step, self._draft(io.tasks))
            elif isinstance(io, VerifyCall):
                io = advance(step, self._verify(io.tasks))
            else:
                yield from io.events
                io = advance(step)
        self.times.steps += 1
        self.times.step_s += time.perf_counter() - step_start

    def _draft(self, tasks: list) -> list:
        if not tasks:
            return []
        start = time.perf_counter()
        drafts = self.drafter.draft(tasks)
        if drafts:
            self.orchestrator.observe_draft(len(tasks), max(d.forwards for d in drafts), time.perf_counter() - start)
        return drafts

    def _verify(self, tasks: list) -> list:
        fed, start = self.target.stats.tokens, time.perf_counter()
        results = self.verifier.verify(tasks)
        fed = self.target.stats.tokens - fed
        lengths = [t.fed for t in tasks]  # the sequences' tokens, unless the forward fed others
        self.orchestrator.observe_verify(fed, time.perf_counter() - start,
                                         lengths=lengths if fed == sum(lengths) else None)
        return results

    def forward_s(self) -> float:
        """Seconds inside the models' own forwards so far (every runner's ``stats.forward_s``)."""
        return sum(r.stats.forward_s for r in self._runners)

    def set_costs(self, verify, draft) -> None:
        """Use these cost tables (calid.planning.CostTable) for the auto mode instead of measuring (see
        Orchestrator.pin_costs)."""
        self._calibrated = True
        self.orchestrator.pin_costs(verify, draft)

    def calibrate(self) -> None:
        """Measure target and draft forward costs once, for the auto mode's planner."""
        from calid.calibration import draft_costs, prefill_cost, verify_costs

        orch = self.orchestrator
        self._calibrated = True
        orch.verify_cost = verify_costs(self.target)
        if self.draft is not None:
            orch.draft_cost = draft_costs(self.draft)
            orch.draft_prefill_s = prefill_cost(self.draft)

    def _release(self, done: list[RequestState]) -> None:
        if not done:
            return
        ids = [s.req.request_id for s in done]
        self.verifier.release(ids, {s.req.request_id: s.token_ids for s in done})
        if self.drafter is not None:
            self.drafter.release(ids)


def check_pair(target, draft) -> None:
    """A draft must speak the target's tokenizer (LoadedModels)."""
    if draft is not None and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise EngineConfigError(f"draft {draft.name} and target {target.name} have different tokenizers")


def check_vocab(target, draft) -> None:
    """Draft and target (calid.backends.OpenModel) must share a tokenizer and agree on the logits' width."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise EngineConfigError(f"draft {draft.name} and target {target.name} have different tokenizers")
    if draft.runner.vocab_size != target.runner.vocab_size:
        raise EngineConfigError(f"draft {draft.name} ({draft.runner.vocab_size} logits) and target {target.name} "
                           f"({target.runner.vocab_size}) disagree on the vocabulary size")
