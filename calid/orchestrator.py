"""The request-side state machine shared by calid.Engine and the Serve router.

The orchestrator owns every in-flight request (``RequestState``: token ids,
text stream, RNG, stats) and turns one decoding step into two rounds of
plain-data calls to model workers (calid.workers.messages):

  1. ``draft_tasks``   what each request asks of the draft worker;
  2. ``after_draft``   appends filter drafts that were confident all the way
                       (early acceptance: no target call, unless the step
                       calls the target anyway) and returns the verify tasks
                       of every request that needs the target;
  3. ``after_verify``  appends what the target accepted and produced.
A caller with a round trip to its target may first ``lengthen_plain_steps``: a
step where every request decodes plain runs several tokens in one call.
Mode ``ar`` skips step 1; ``lookahead`` drafts from the target worker's trie.

``Orchestrator.step`` is that sequence, once, for every caller: a generator
that yields what it needs done (``DraftCall``, ``VerifyCall``, ``Deliver``) and
is sent what came back. It does no I/O: calid.Engine answers with function
calls, the Serve router (serve_app/router) with awaited worker calls, retries
and failures of its own; both step the same way.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Hashable

from calid.decoding.budget import AgreementTable, BudgetController
from calid.decoding.modes import DecodeParams
from calid.decoding.ngram import MAX_CHAIN, Copy, CopyHazard, CopyShare, NgramIndex
from calid.errors import CalidError
from calid.generation import GenerationRequest, RequestState, StreamEvent, validate_request
from calid.planning import (AR, Acceptance, Choice, CostTable, Forecast, Gain, GroupPlan, PlanInput, StepGuard,
                            batch_level, draft_depth, plan_group)
from calid.workers.messages import DraftResult, DraftTask, VerifyResult, VerifyTask

ADAPT_STEP = 0.05  # LLMCad-style threshold adaptation per verification
# a budget request whose draft has been confident all along still has the target look (catch up, compare its
# top-1 with each draft token, add one token) once this many draft tokens await it: a budget needs feedback.
# Other audited requests are only observed: their output is what it would be unaudited
AUDIT_SPAN = 32
MAX_RUN_STEPS = 8  # most plain steps one target call runs (lengthen_plain_steps)


class EngineConfigError(CalidError):
    """Draft and target cannot work together (e.g. different vocabularies), or a mode needs a missing draft."""


@dataclass(frozen=True)
class DraftCall:
    """Run the draft worker on ``tasks`` (possibly none) and send back its DraftResults. A request the caller
    could not draft for either goes without (no result) or is failed by the caller (``Orchestrator.finish``)."""

    tasks: list[DraftTask]


@dataclass(frozen=True)
class VerifyCall:
    """Run the target worker on ``tasks`` and send back its VerifyResults (a failed request: finished, as above)."""

    tasks: list[VerifyTask]


@dataclass(frozen=True)
class Deliver:
    """Hand these events to their requests' streams; send back nothing."""

    events: list[StreamEvent]


StepIO = DraftCall | VerifyCall | Deliver


class Orchestrator:
    def __init__(self, tokenizer, eos_ids: frozenset[int], max_position: int, has_draft: bool,
                 default_decode: DecodeParams | None = None):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.max_position = max_position
        self.has_draft = has_draft
        self.default_decode = default_decode or DecodeParams(mode="auto" if has_draft else "ar")
        self.active: dict[Hashable, RequestState] = {}
        self._ids = itertools.count()
        # the planner's inputs (auto mode): forward costs measured by the caller, acceptance per request.
        # verify_cost pools every target forward; a server with several target replicas also keeps one table per
        # replica (seeded from the pooled one) and says, through replica_of, which replica holds a request
        self.verify_cost, self.draft_cost = CostTable(), CostTable()
        self.costs_pinned = False  # pin_costs: the tables are given, timings no longer change them
        # the target splits a batch into slices of equal tokens per sequence (llama.cpp with a KV stream per sequence):
        # plans price a verification by its slices (calid.planning.split_cost), and only forwards of one slice (every
        # sequence as long) are timed into the table
        self.sliced = False
        self.padding = True  # a sliced target pads a step's shorter chains to its level (_level); not in exact mode
        self.replica_costs: dict[Hashable, CostTable] = {}
        self.replica_of: Callable[[Hashable], Hashable | None] = lambda request_id: None
        self._acceptance: dict[Hashable, Acceptance] = {}
        self._lookahead_gain: dict[Hashable, Gain] = {}  # auto requests: what their Lookahead steps yield
        self._tree_acceptance: dict[Hashable, Acceptance] = {}  # auto requests: how their token trees fare
        self._step_decode: dict[Hashable, DecodeParams] = {}  # auto requests: this step's effective mode
        self._variants: dict[Hashable, dict[tuple[str, int], DecodeParams]] = {}  # their modes' parameters, made once
        # auto requests: n-gram drafts (calid.decoding.ngram) from each request's own ids, and this step's
        # n-gram chains (verified as speculative, no draft call)
        self._ngrams: dict[Hashable, NgramIndex] = {}
        self._ngram_step: dict[Hashable, list[int]] = {}
        self._ngram_proposal: dict[Hashable, Copy] = {}  # this step's n-gram copy per auto request
        self.copy_hazard = CopyHazard()  # how copies hold on this server's traffic, learned from their verifications
        self._copy_share: dict[Hashable, CopyShare] = {}  # per auto request: how much of its output copies foresaw
        self._drafted_at: dict[Hashable, int] = {}  # auto request -> its output length when it last planned a draft
        self.planned = Counter()  # auto requests' steps by the planner's choice (ar, ngram, speculative, ...)
        # the planner's forecasts against measured outcomes: steps that drafted (by how much they bet) vs plain steps,
        # per batch size; the caller times each whole step (observe_step), and the guard may run a planned drafting
        # step plain
        self.guard: StepGuard | None = StepGuard()  # None: plans are followed as made (pinned cost tables)
        # this step's states, how deep it drafts (calid.planning.draft_depth; 0: plain), each one's output length
        # before it, what the planner forecast of it, and per target replica its auto requests and their plan (which
        # judges what the step saved)
        self._timed_step: tuple[list[RequestState], int, list[int], Forecast,
                                list[tuple[list[RequestState], GroupPlan]]] | None = None
        # the draft model's catch-up: seconds per token it prefills (measured by the caller), and how many of each
        # request's ids its last draft task carried (what its cache holds, unless evicted)
        self.draft_prefill_s = 0.0
        self._draft_seen: dict[Hashable, int] = {}
        self.draft_available = True  # False while the draft workers cannot be reached: every step is plain
        # filter's quality: how often the draft's top-1 is the target's, by draft confidence (calid.decoding.budget;
        # the caller may start it from a calibration file), what min_agreement requests have agreed so far, and the
        # draft tokens each audited request has not had compared yet (position -> the draft's top-1 probability).
        # Requests with a budget are audited, and one in ``audit_every`` other filter requests (0: none)
        self.agreement = AgreementTable()
        self.audit_every = 0
        self.audited = [0, 0]  # output tokens of audited requests that agreed with the target's top-1, of counted
        self._budgets: dict[Hashable, BudgetController] = {}
        self._unaudited: dict[Hashable, dict[int, float]] = {}
        self._filter_seen = 0
        self._plain: set[Hashable] = set()  # requests this step runs without their draft (plain_step)

    # ---- admission ------------------------------------------------------------------

    def validate(self, req: GenerationRequest, edge: bool = False) -> GenerationRequest:
        """Fill defaults and check the request; raises InvalidRequestError / EngineConfigError.
        ``edge``: the client drafts (calid.edge), so no draft model is needed here."""
        if req.request_id is None:
            req.request_id = f"req-{next(self._ids)}"
        if req.decode is None:
            req.decode = self.default_decode
        validate_request(req, self.max_position)
        req.decode.validate()
        if req.decode.uses_draft and not self.has_draft and not edge:
            raise EngineConfigError(f"mode {req.decode.mode!r} needs a draft model; this deployment has none")
        return req

    def start(self, req: GenerationRequest, arrived: float | None = None) -> RequestState:
        """Make ``req`` active; ``arrived`` (time.perf_counter() when it arrived, default now) is where its
        TTFT and latency count from, so that time spent queued for a slot counts."""
        if req.request_id in self.active:
            raise CalidError(f"request id {req.request_id!r} is already in flight")
        start = time.perf_counter() if arrived is None else arrived
        s = self.active[req.request_id] = RequestState(req, self.tokenizer, self.eos_ids, start)
        if req.decode.mode == "filter":
            self._filter_seen += 1
            if req.decode.min_agreement is not None:
                self._budgets[req.request_id] = BudgetController(req.decode.min_agreement)
            if req.decode.min_agreement is not None or (self.audit_every and self._filter_seen % self.audit_every == 0):
                self._unaudited[req.request_id] = {}
        return s

    def finish(self, request_id: Hashable) -> RequestState | None:
        self._forget(request_id)
        return self.active.pop(request_id, None)

    def finished(self) -> list[RequestState]:
        """Remove and return the requests that are done."""
        done = [s for s in self.active.values() if s.finish_reason]
        for s in done:
            del self.active[s.req.request_id]
            self._forget(s.req.request_id)
        return done

    def _forget(self, request_id: Hashable) -> None:
        self._acceptance.pop(request_id, None)
        self._lookahead_gain.pop(request_id, None)
        self._tree_acceptance.pop(request_id, None)
        self._step_decode.pop(request_id, None)
        self._variants.pop(request_id, None)
        self._plain.discard(request_id)
        self._ngrams.pop(request_id, None)
        self._ngram_step.pop(request_id, None)
        self._ngram_proposal.pop(request_id, None)
        self._copy_share.pop(request_id, None)
        self._drafted_at.pop(request_id, None)
        self._draft_seen.pop(request_id, None)
        self._budgets.pop(request_id, None)
        self._unaudited.pop(request_id, None)

    # ---- the planner's measurements -------------------------------------------------

    def pin_costs(self, verify: CostTable, draft: CostTable) -> None:
        """Plan with these cost tables as given: timings no longer change them and plans are followed as made
        (no StepGuard: nothing measured second-guesses them)."""
        self.verify_cost, self.draft_cost = verify, draft
        self.costs_pinned, self.guard = True, None

    def observe_verify(self, tokens: int, seconds: float, replica: Hashable | None = None,
                       lengths: list[int] | None = None) -> None:
        """A target forward over ``tokens`` new tokens took ``seconds`` (caller-measured, transport included),
        on ``replica`` (None: the only one, or a calibration, which also fills the sizes a replica's table lacks).
        ``lengths``: its sequences' tokens, where known; with ``sliced`` a forward counts only when they are
        all equal (one slice: the table's sizes are such forwards)."""
        if self.costs_pinned or (self.sliced and len(set(lengths or ())) != 1):
            return
        if replica is not None:
            pooled = self.verify_cost
            table = self.replica_costs.setdefault(replica, CostTable(list(pooled.sizes), list(pooled.seconds)))
            table.observe(tokens, seconds)
        else:  # a calibration: replicas timed before it get the sizes they have not seen (a table that knows only
            for table in self.replica_costs.values():  # one size would price every verification proportionally)
                if tokens not in table.sizes:
                    table.observe(tokens, seconds)
        self.verify_cost.observe(tokens, seconds)

    def verify_cost_of(self, replica: Hashable | None) -> CostTable:
        """The cost table for a target forward on ``replica`` (the pooled one until that replica is timed)."""
        return self.verify_cost if replica is None else self.replica_costs.get(replica, self.verify_cost)

    def observe_draft(self, sequences: int, depth: int, seconds: float) -> None:
        """A draft call over ``sequences`` requests ``depth`` forwards deep took ``seconds``."""
        if depth > 0 and not self.costs_pinned:
            self.draft_cost.observe(sequences, seconds / depth)

    def observe_step(self, seconds: float) -> None:
        """The step that the last draft_tasks planned took ``seconds`` from planning to the target's results
        (caller-measured): the guard's measure of steps that drafted vs plain steps, for auto steps past their
        prefill."""
        if self._timed_step is not None and self.guard is not None:
            states, depth, before, forecast, groups = self._timed_step
            self._timed_step = None
            made = {id(s): len(s.output) - n for s, n in zip(states, before)}
            saved = sum(planned.saved([made[id(s)] for s in auto]) for auto, planned in groups)
            self.guard.observe(len(states), depth, seconds, sum(made.values()), saved, forecast)

    def decode_of(self, s: RequestState) -> DecodeParams:
        """The mode a request runs this step (auto: what the planner chose)."""
        return self._step_decode.get(s.req.request_id, s.req.decode)

    # ---- one step ---------------------------------------------------------------------

    def step(self, states: list[RequestState], own_drafts: list[DraftResult] = ()
             ) -> Generator[StepIO, list | None, None]:
        """One decoding step over ``states``, sans I/O (the module's docstring). ``own_drafts``: drafts the caller
        already holds (an edge client's round): their requests are not planned or drafted here. The step is timed
        from planning to the target's results for the planner's guard (``observe_step``)."""
        start = time.perf_counter()
        own = {d.request_id for d in own_drafts}
        drafts = yield DraftCall(self.draft_tasks([s for s in states if s.req.request_id not in own]))
        states = [s for s in states if s.req.request_id in self.active]  # what the caller failed is gone
        events, verify = self.after_draft(states, [*(drafts or ()), *own_drafts])
        if events:
            yield Deliver(events)
        if verify:
            results = yield VerifyCall(verify)
            yield Deliver(self.after_verify(results or []))
        self.observe_step(time.perf_counter() - start)

    def draft_tasks(self, states: list[RequestState]) -> list[DraftTask]:
        for rid in self._plain:  # last step's fallbacks end with it
            self._step_decode.pop(rid, None)
        self._plain.clear()
        self._ngram_step.clear()
        self._timed_step = None
        self._plan(states)
        for s in states:
            budget = self._budgets.get(s.req.request_id)
            if budget is not None:
                s.set_threshold(budget.threshold(self.agreement))
        if not self.draft_available:
            self.plain_step([s.req.request_id for s in states if s.req.request_id not in self._ngram_step])
        tasks = [DraftTask(s.req.request_id, s.token_ids, self.decode_of(s), s.req.params.warp, s.confidence.nll,
                           self._draft_budget(s), _rng(s), prompt_len=len(s.req.prompt_ids)) for s in states
                 if self.decode_of(s).uses_draft and not s.prefilling  # a draft is wasted while the target prefills
                 and s.req.request_id not in self._ngram_step]  # an n-gram chain needs no draft model
        for t in tasks:
            self._draft_seen[t.request_id] = len(t.token_ids)
        return tasks

    def plain_step(self, request_ids: list[Hashable]) -> None:
        """These requests take this step without a draft: the target generates their next token, as in ar
        (lossless modes keep their output: greedy, it is the token verification would have kept)."""
        for rid in request_ids:
            s = self.active.get(rid)
            if s is not None and self.decode_of(s).uses_draft:
                self._step_decode[rid] = replace(self.decode_of(s), mode="ar")
                self._plain.add(rid)

    def _plan(self, states: list[RequestState]) -> None:
        """Auto requests: this step's mode from the planner: a draft chain of some length (speculative) or a
        token tree (both with a draft model), a Lookahead step (drafts from the target's trie), or a plain
        target step (ar). Requests are planned by the target replica that holds them, each group with that
        replica's costs and beside that replica's other work (replicas run their forwards side by side)."""
        if not any(s.req.decode.mode == "auto" for s in states):
            return
        if self.guard is not None and not self.guard.plans(len(states)):  # drafting at this size measurably loses
            self._follow([(s, AR) for s in states if s.req.decode.mode == "auto"])
            return
        draft_cost = self.draft_cost if self.has_draft else CostTable()  # no draft model: no chains or trees
        by_replica: dict[Hashable | None, list[RequestState]] = {}
        for s in states:
            by_replica.setdefault(self.replica_of(s.req.request_id), []).append(s)
        plans, extra, groups = [], [], []  # extra: tokens each request's choice expects beyond a plain step's one
        seconds = plain_seconds = 0.0  # replicas run their forwards side by side: the step takes the slowest's
        saving = plain_saving = 0.0  # and their savings add up
        for replica, group in by_replica.items():
            auto = [s for s in group if s.req.decode.mode == "auto"]
            if auto:
                inputs = [self._plan_input(s) for s in auto]
                verify, fixed = self.verify_cost_of(replica), len(group) - len(auto)
                planned = plan_group(inputs, verify, draft_cost, fixed, sliced=self.sliced)
                plans += zip(auto, planned.chosen)
                extra += [r.tokens(c) - 1 for r, c in zip(inputs, planned.chosen)]
                groups.append((auto, planned))
                (saves, secs), (plain_saves, plain_secs) = planned.forecast, planned.plain
                saving, seconds = saving + saves, max(seconds, secs)
                plain_saving, plain_seconds = plain_saving + plain_saves, max(plain_seconds, plain_secs)
        forecast = Forecast(saving, seconds, plain_saving, plain_seconds)
        drafts = any(c.mode != "ar" for _, c in plans)
        depth = draft_depth(sum(extra)) if drafts else 0
        if depth and self.guard is not None and not self.guard.allow(len(states), depth, forecast):
            plans, depth = [(s, AR) for s, _ in plans], 0  # drafting as forecast measurably loses: plain
        # a step that prefills (a new request's whole prompt, or a chunk of it) says nothing of decoding: under a
        # closed loop at 8 requests such steps made plain steps read 137 ms per token instead of ~28
        if all(s.stats.target_calls for s in states):
            timed = forecast if depth else Forecast.plain(plain_saving, plain_seconds)
            self._timed_step = (states, depth, [len(s.output) for s in states], timed, groups)
        self._follow(plans)

    def _follow(self, plans: list[tuple[RequestState, Choice]]) -> None:
        """This step's mode of each planned request."""
        self.planned.update(c.mode for _, c in plans)
        for s, c in plans:
            rid = s.req.request_id
            if c.mode != "ar":
                self._drafted_at[rid] = len(s.output)
            if c.mode == "ngram":  # verified as a greedy draft chain (one-hot draft rows when sampled)
                self._ngram_step[rid] = self._ngram_proposal[rid].tokens[: c.gamma]
            self._step_decode[rid] = self._variant(s, "speculative" if c.mode == "ngram" else c.mode,
                                                   c.gamma or s.req.decode.gamma)

    def _variant(self, s: RequestState, mode: str, gamma: int) -> DecodeParams:
        """The request's decode parameters with this step's mode and gamma, made once per pair (made anew each
        step, with dataclasses.replace, they cost 2.5 us a request warm)."""
        made = _held(self._variants, s.req.request_id, dict)
        params = made.get((mode, gamma))
        if params is None:
            params = made[mode, gamma] = replace(s.req.decode, mode=mode, gamma=gamma)
        return params

    def _plan_input(self, s: RequestState) -> PlanInput:
        rid, decode = s.req.request_id, s.req.decode
        # an untried tree starts a little above a chain's prior (it also tries the draft's next-best tokens
        # where it is unsure), so it gets tried where verifying its extra tokens is nearly free
        tree = _held(self._tree_acceptance, rid, lambda: Acceptance(accepted=1.0)) if self.has_draft else None
        cap = 0 if s.prefilling else self._draft_budget(s, decode.gamma)
        ngram = _held(self._ngrams, rid, NgramIndex)
        ngram.extend(s.token_ids)
        # a copy is not bound by gamma (a draft model's chain length): it costs only its verification
        copy = ngram.copy(0 if s.prefilling else self._draft_budget(s, max(decode.gamma, MAX_CHAIN)))
        self._ngram_proposal[rid] = copy
        share = _held(self._copy_share, rid, CopyShare).value
        return PlanInput.of_copy(copy, self.copy_hazard.survival(copy, share),
                                 alpha=_held(self._acceptance, rid, Acceptance).alpha, cap=cap,
                                 lookahead_gain=_held(self._lookahead_gain, rid, Gain).mean,
                                 tree_alpha=tree.alpha if tree else None, tree_width=decode.tree_width,
                                 tree_chains=decode.tree_chains, remaining=self._tokens_left(s),
                                 draft_setup_s=self.draft_prefill_s * max(0, len(s.token_ids)
                                                                          - self._draft_seen.get(rid, 0) - 1))

    def after_draft(self, states: list[RequestState], results: list[DraftResult]
                    ) -> tuple[list[StreamEvent], list[VerifyTask]]:
        drafts = {r.request_id: r for r in results}
        events, tasks, now = [], [], time.perf_counter()
        confident: list[tuple[RequestState, DraftResult]] = []  # filter chains confident all along
        for s in states:
            d = drafts.get(s.req.request_id)
            if d is not None:
                s.stats.draft_calls += d.forwards
                _set_rng(s, d.rng)
            unaudited = self._unaudited.get(s.req.request_id)
            if unaudited is not None and d is not None:
                self._pend_audit(s, d, unaudited)
            if d is not None and d.catching_up and self.decode_of(s).mode == "filter":
                continue  # filter waits for its draft's prefill, or the target (the dearer model) would prefill it too
            if d is not None and not d.needs_target and not (  # filter, every draft token confident: early acceptance,
                    s.req.request_id in self._budgets and len(unaudited) >= AUDIT_SPAN):  # unless a budget needs a look
                confident.append((s, d))
                continue
            tasks.append(self._verify_task(s, d, unaudited))
        # a step that calls the target anyway verifies the confident chains drafted here too (the target adds a
        # token after each): catching up now, in lockstep with the others, keeps every sequence's new tokens
        # equally long, so the forward runs as one slice (one read of the weights) rather than one per length;
        # an edge client's round (no confidences) keeps its early acceptance
        for s, d in confident:
            if tasks and d.probs is not None:
                tasks.append(self._verify_task(s, d, self._unaudited.get(s.req.request_id)))
            else:
                events += self._append(s, d.tokens, len(d.tokens), now)
        if self.sliced and self.padding:
            self._level(tasks)
        return events, tasks

    def _level(self, tasks: list[VerifyTask]) -> None:
        """Where the target splits a batch into slices, pad the shorter chains of each target replica's forward
        up to the level that prices it lowest (calid.planning.batch_level: a batch of mixed lengths costs up to
        twice one of equal lengths). Only forwards of chains past their prefill: a prompt's or a tree's tokens
        are not the task's draft."""
        groups: dict[Hashable | None, list[VerifyTask]] = {}
        for t in tasks:
            groups.setdefault(self.replica_of(t.request_id), []).append(t)
        for replica, group in groups.items():
            states = [self.active[t.request_id] for t in group]
            if len(group) < 2 or any(t.tree is not None or t.decode.is_tree or s.prefilling or not s.stats.target_calls
                                     for t, s in zip(group, states)):
                continue
            lengths = [1 + len(t.draft) for t in group]
            level = batch_level(lengths, self.verify_cost_of(replica))
            if level > min(lengths):
                for t in group:
                    t.level = level

    def _verify_task(self, s: RequestState, d: DraftResult | None, unaudited: dict[int, float] | None
                     ) -> VerifyTask:
        ngram = self._ngram_step.get(s.req.request_id)
        return VerifyTask(s.req.request_id, s.token_ids, len(s.req.prompt_ids), self.decode_of(s),
                          s.req.params.warp, self._draft_budget(s),
                          ngram if ngram is not None else d.tokens if d else [],
                          d.q if d else None, d.tree if d else None, _rng(s),
                          audit_from=min(unaudited) if unaudited else None, unsure=tuple(d.unsure or ()) if d else ())

    def lengthen_plain_steps(self, tasks: list[VerifyTask], budget_s: float) -> int:
        """Where every task of this step is a plain decode step (ar, or auto planned as ar; no draft, past its
        prefill), let the target run up to k of them in the one call: k as many forwards of this batch as fit in
        ``budget_s`` by the measured cost table, at most MAX_RUN_STEPS and at most the tokens and context any of
        the requests has left (a request that ends in a run would wait for the others' steps to hear its last
        tokens), each request's run ended by its EOS. An auto request runs at most as many steps as it has made
        since it last planned a draft: a run cannot take a copy that turns up meanwhile (grounded c1 on the
        2-core Xeon: auto 6.88 -> 6.07 tok/s with runs of up to 8 whatever it drafted), while one that has not
        drafted for long soon runs as long as ar. A caller whose every call has a round trip (the router: a
        few ms of transport and Python on a 2-core CPU, each step) pays it once per run instead of once per
        token; the tokens are the same, they arrive k at a time. Returns k (1: single steps)."""
        k = self.plain_run_room(tasks, budget_s)
        if k < 2:
            return 1
        for t in tasks:
            t.steps = k
            t.stop_ids = frozenset() if self.active[t.request_id].req.params.ignore_eos else self.eos_ids
        return k

    def plain_run_room(self, tasks: list[VerifyTask], budget_s: float) -> int:
        """How many plain steps, this one included, a run starting at this step may take (lengthen_plain_steps,
        which says when a step is one); 1: none. Changes nothing (a caller that runs the steps one by one may
        still stream their tokens a run at a time)."""
        if budget_s <= 0 or not tasks or not self.verify_cost.known:
            return 1
        states = [self.active.get(t.request_id) for t in tasks]
        if any(s is None or s.prefilling or not s.stats.target_calls or t.draft or t.tree is not None
               or t.decode.mode != "ar" or t.audit_from is not None for t, s in zip(tasks, states)):
            return 1
        return max(1, min(MAX_RUN_STEPS, int(budget_s / self.verify_cost(len(tasks))), *map(self._run_room, states)))

    def _run_room(self, s: RequestState) -> int:
        """Most plain steps ``s`` may take in a run: its tokens (or context) left, and for auto the steps it has
        made since it last planned a draft."""
        room = self._tokens_left(s)
        if s.req.decode.mode == "auto":
            room = min(room, len(s.output) - self._drafted_at.get(s.req.request_id, 0))
        return room

    def _pend_audit(self, s: RequestState, d: DraftResult, unaudited: dict[int, float]) -> None:
        """Remember the confidence of each draft token this step appends (or sends to the target), to be
        compared with the target's top-1 when the target next sees it."""
        if d.tokens and d.probs is None:  # drafted where confidences are not reported (an edge client's round)
            self._unaudited.pop(s.req.request_id, None)
            return
        at = len(s.token_ids)
        unaudited.update((at + i, p) for i, p in enumerate(d.probs or ()))

    def after_verify(self, results: list[VerifyResult]) -> list[StreamEvent]:
        events, now = [], time.perf_counter()
        for v in results:
            s = self.active.get(v.request_id)
            if s is None:  # cancelled while the target worked
                continue
            _set_rng(s, v.rng)
            s.prefilling = not v.tokens  # the target only prefilled a chunk of the prompt (SARATHI)
            if s.prefilling:
                s.stats.prefill_chunks += 1
                continue
            s.stats.target_calls += v.forwards
            s.stats.record_verification(v.proposed, v.accepted, v.verifying)
            rid = s.req.request_id
            step_mode = self.decode_of(s).mode if s.req.decode.mode == "auto" else None
            copy, share = self._ngram_proposal.get(rid), self._copy_share.get(rid)
            if copy is not None and share is not None:  # an auto request
                if rid in self._ngram_step:  # an n-gram chain: how far it held teaches the price of copies like it
                    self.copy_hazard.observe(copy, share.value, v.proposed, v.accepted)
                share.update(copy.tokens, v.tokens)
            if rid in self._ngram_step:
                pass  # an n-gram chain says nothing of the draft model's acceptance
            elif step_mode == "lookahead":
                self._lookahead_gain[rid].observe(v.accepted)
            elif step_mode == "tree" and rid in self._tree_acceptance:
                self._tree_acceptance[rid].observe(v.accepted, v.proposed)
            elif v.verifying and rid in self._acceptance:
                self._acceptance[rid].observe(v.accepted, v.proposed)
            self._adapt(s, v.accepted, v.proposed)
            if rid in self._unaudited:
                self._audit(rid, v, len(s.token_ids) + v.accepted)
            events += self._append(s, v.tokens, v.accepted, now, v.decided)
        return events

    def _audit(self, rid: Hashable, v: VerifyResult, kept: int) -> None:
        """Fold what the target saw into the agreement table and the request's budget: each audited draft
        token (its top-1 there was, or was not, that token) and the target's own token (it agrees when it is
        the target's top-1: always, greedy). Filter's draft tokens from ``kept`` on are not output: the target
        picked another token there; that one is observed, and those after it (drafted in a context the output
        does not have) are not."""
        unaudited, budget = self._unaudited[rid], self._budgets.get(rid)
        agreed = counted = 0
        for pos, match in enumerate(v.audit or (), start=v.audit_from):
            prob = unaudited.pop(pos, None)
            if prob is not None and pos <= kept:
                self.agreement.observe(prob, match)
                if pos < kept:
                    agreed, counted = agreed + match, counted + 1
        if v.audit is not None:  # what the target did not recompute (it was cached) cannot be audited any more
            for pos in [p for p in unaudited if p < v.audit_from]:
                del unaudited[pos]
        if v.top1 is not None:
            agreed, counted = agreed + (v.tokens[-1] == v.top1), counted + 1
        self.audited[0] += agreed
        self.audited[1] += counted
        if budget is not None:
            budget.record(agreed, counted)

    # ---- helpers ----------------------------------------------------------------------

    def _append(self, s: RequestState, new: list[int], from_draft: int, now: float, decided: tuple[int, ...] = ()
                ) -> list[StreamEvent]:
        """Append ``new`` (its first ``from_draft`` tokens came from the draft, but for those at ``decided``: filter
        tokens the target picked) until the request finishes: one event."""
        return [s.extend(new, now, from_draft, decided, self.max_position)] if new else []

    def _draft_budget(self, s: RequestState, gamma: int | None = None) -> int:
        """Most draft tokens worth proposing now: the step's gamma, the request's remaining budget, the context."""
        decode = self.decode_of(s)
        return draft_budget(decode.mode, decode.gamma if gamma is None else gamma, self._tokens_left(s))

    def _tokens_left(self, s: RequestState) -> int:
        """Tokens the request may still produce: its max_new_tokens less its output, or the context left."""
        return min(s.req.params.max_new_tokens - len(s.output), self.max_position - len(s.token_ids))

    def round_budget(self, req: GenerationRequest, produced: int = 0) -> int:
        """Most draft tokens an edge client's next round may carry, ``produced`` tokens into the output."""
        return draft_budget(
            req.decode.mode,
            req.decode.gamma,
            min(req.params.max_new_tokens - produced, self.max_position - len(req.prompt_ids) - produced),
        )

    @staticmethod
    def _adapt(s: RequestState, accepted: int, proposed: int) -> None:
        if not s.req.decode.adaptive or proposed == 0:
            return
        step = ADAPT_STEP if accepted < proposed else -ADAPT_STEP
        s.set_threshold(min(0.99, max(0.0, s.threshold + step)))


def _held(table: dict, key: Hashable, make: Callable[[], Any]) -> Any:
    """``table[key]``, made by ``make()`` the first time (``setdefault`` builds a new one on every call: an n-gram
    index's tables and four estimators a planning step, thrown away)."""
    value = table.get(key)
    if value is None:
        value = table[key] = make()
    return value


def advance(step: Generator[StepIO, list | None, None], reply: list | None = None) -> StepIO | None:
    """Send ``reply`` into a step (Orchestrator.step) and return what it asks next; None once it is over."""
    try:
        return step.send(reply)
    except StopIteration:
        return None


def draft_budget(mode: str, gamma: int, left: int) -> int:
    """Most draft tokens a step of ``mode`` may propose with ``left`` tokens to go: ``gamma`` at most, and one
    fewer than left where the target adds a token of its own (every mode but filter)."""
    spare = left if mode == "filter" else left - 1  # verifying modes add a target token
    return max(0, min(gamma, spare))


def _rng(s: RequestState):
    return None if s.req.params.warp.greedy else s.generator.get_state()


def _set_rng(s: RequestState, state) -> None:
    if state is not None:
        s.generator.set_state(state)
