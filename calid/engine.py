"""calid.Engine: one decoding loop for every mode.

Each step, for all active requests together:
  1. draft   the draft model extends each request that uses it, one token per
             batched forward, until the request's confidence test fails or its
             gamma cap is hit (dynamic draft length);
  2. verify  one batched target forward over every request that needs the
             target: its not-yet-cached committed tokens plus its pending
             draft tokens, with logits at each pending position and one after;
  3. accept  the request's acceptance rule (filter / rollback / speculative)
             keeps a prefix of the draft and supplies the next token;
  4. append  token ids are the source of truth; both models' KV caches are
             soft state that the next ``sync`` rolls back to the committed ids.
Mode ``ar`` is the same loop with no draft: the target supplies every token.
Modes ``tree`` and ``lookahead`` draft a token tree instead of a chain and
verify it with a tree mask (calid.tree_step).
Filter requests whose drafts were all confident skip step 2 entirely (early
acceptance); the target catches up on those tokens the next time it runs.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch

from calid.decoding.acceptance import RuleInput, get_rule
from calid.decoding.confidence import top1
from calid.decoding.lookahead import LookaheadConfig
from calid.decoding.modes import DecodeParams
from calid.decoding.sampling import sample, warp
from calid.errors import CalidError
from calid.generation import GenerationRequest, GenerationResult, RequestState, StreamEvent, validate_request
from calid.runtime.runner import ModelRunner, SeqInput
from calid.tree_step import TreeStepper

ADAPT_STEP = 0.05  # LLMCad-style threshold adaptation per verification


class EngineConfigError(CalidError):
    """Draft and target cannot work together (e.g. different vocabularies)."""


@dataclass
class _Pending:
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # warped draft rows [V]
    done: bool = False
    needs_target: bool = True


class Engine:
    def __init__(self, target: ModelRunner, tokenizer, eos_ids: frozenset[int], draft: ModelRunner | None = None,
                 max_batch: int = 8, default_decode: DecodeParams | None = None,
                 lookahead: LookaheadConfig | None = None, shared_trie: bool = True):
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise EngineConfigError(
                f"draft and target have different vocabularies ({draft.vocab_size} vs {target.vocab_size} tokens); "
                "a draft must share the target's tokenizer"
            )
        self.target, self.draft = target, draft
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.max_batch = max_batch
        self.max_position = target.model.cfg.max_position
        self.default_decode = default_decode or DecodeParams(mode="ar" if draft is None else "speculative")
        self.trees = TreeStepper(target, draft, lookahead or LookaheadConfig(), shared_trie)
        self._ids = itertools.count()

    @classmethod
    def from_loaded(cls, target, draft=None, max_batch: int = 8, kv_budget_bytes: int | None = None,
                    lookahead: LookaheadConfig | None = None) -> "Engine":
        """Engine over LoadedModels (``calid.load_model``); refuses a draft with another tokenizer."""
        if draft is not None and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise EngineConfigError(f"draft {draft.name} and target {target.name} have different tokenizers")
        return cls(ModelRunner(target.model, kv_budget_bytes), target.tokenizer, target.eos_ids,
                   draft=ModelRunner(draft.model, kv_budget_bytes) if draft is not None else None, max_batch=max_batch,
                   lookahead=lookahead)

    # ---- public API -----------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = {}
        for event in self.stream(requests):
            if event.result is not None:
                results[event.request_id] = event.result
        return [results[r.request_id] for r in requests]

    def stream(self, requests: list[GenerationRequest]) -> Iterator[StreamEvent]:
        for req in requests:
            self._admit(req)
        waiting = list(requests)
        active: list[RequestState] = []
        try:
            while waiting or active:
                while waiting and len(active) < self.max_batch:
                    active.append(RequestState(waiting.pop(0), self.tokenizer, self.eos_ids, time.perf_counter()))
                    self.trees.admit(active[-1])
                yield from self._step(active)
                for done in [s for s in active if s.finish_reason]:
                    self._release(done.req.request_id)
                    active.remove(done)
        finally:  # a consumer that stops early (client gone) frees every cache it held
            for s in active:
                self._release(s.req.request_id)

    # ---- one step -------------------------------------------------------------

    def _admit(self, req: GenerationRequest) -> None:
        if req.request_id is None:
            req.request_id = f"req-{next(self._ids)}"
        if req.decode is None:
            req.decode = self.default_decode
        validate_request(req, self.max_position)
        req.decode.validate()
        if req.decode.uses_draft and self.draft is None:
            raise EngineConfigError(f"mode {req.decode.mode!r} needs a draft model; this engine has none")

    def _step(self, active: list[RequestState]) -> Iterator[StreamEvent]:
        chains = [s for s in active if not s.req.decode.is_tree]
        trees = [s for s in active if s.req.decode.is_tree]
        pending = {s.req.request_id: _Pending(needs_target=s.req.decode.mode != "filter") for s in chains}
        self._draft_phase([s for s in chains if s.req.decode.uses_draft], pending)
        verdicts = self._verify_phase([s for s in chains if pending[s.req.request_id].needs_target], pending)
        tree_verdicts = self.trees.step(trees, {s.req.request_id: self._draft_budget(s) for s in trees}) if trees else {}
        now = time.perf_counter()
        for s in trees:
            tree, v = tree_verdicts[s.req.request_id]
            s.stats.record_verification(tree.max_depth, len(v.path), True)
            yield from self._append(s, [tree.tokens[i] for i in v.path] + [v.next_token], len(v.path), now)
        for s in chains:
            p = pending[s.req.request_id]
            if s.req.request_id in verdicts:
                accepted, nxt = verdicts[s.req.request_id]
                new = p.tokens[:accepted] + [nxt]
                s.stats.record_verification(len(p.tokens), accepted, s.req.decode.mode != "filter")
                self._adapt(s, accepted, len(p.tokens))
            else:  # filter: every draft token was confident, no target call
                new, accepted = p.tokens, len(p.tokens)
            yield from self._append(s, new, accepted, now)

    def _append(self, s: RequestState, new: list[int], from_draft: int, now: float) -> Iterator[StreamEvent]:
        """Append ``new`` (its first ``from_draft`` tokens came from the draft) until the request finishes."""
        added = 0
        for i, token in enumerate(new):
            yield s.append(token, now, from_draft=i < from_draft, max_position=self.max_position)
            added += 1
            if s.finish_reason:
                break
        self.trees.record(s, added)

    def _draft_budget(self, s: RequestState) -> int:
        """Most draft tokens worth proposing now: the request's gamma, its remaining budget, the context."""
        left = min(s.req.params.max_new_tokens - len(s.output), self.max_position - len(s.token_ids))
        spare = left if s.req.decode.mode == "filter" else left - 1  # verifying modes add a target token
        return max(0, min(s.req.decode.gamma, spare))

    def _draft_phase(self, drafting: list[RequestState], pending: dict) -> None:
        for s in drafting:
            if self._draft_budget(s) == 0:
                pending[s.req.request_id].done = True
                pending[s.req.request_id].needs_target = True
        while True:
            live = [s for s in drafting if not pending[s.req.request_id].done]
            if not live:
                return
            inputs = [SeqInput(s.req.request_id, self.draft.sync(s.req.request_id, s.token_ids + pending[s.req.request_id].tokens))
                      for s in live]
            rows = torch.cat(self.draft.forward(inputs))  # [B, V]
            _, nll = top1(rows)  # [B]
            for s, row, row_nll in zip(live, rows, nll.tolist()):
                self._extend_draft(s, pending[s.req.request_id], row, row_nll)

    def _extend_draft(self, s: RequestState, p: _Pending, row: torch.Tensor, nll: float) -> None:
        confident = nll <= s.confidence.nll
        if s.req.decode.mode == "filter" and not confident:
            p.done, p.needs_target = True, True  # the target generates this token
            return
        q = warp(row[None], s.req.params.warp)[0]
        token = int(sample(q[None], s.generator)[0])
        p.tokens.append(token)
        p.q.append(q)
        s.stats.draft_calls += 1
        if not confident or len(p.tokens) >= self._draft_budget(s) or token in self.eos_ids:
            p.done = True

    def _verify_phase(self, verify: list[RequestState], pending: dict) -> dict[Hashable, tuple[int, int]]:
        if not verify:
            return {}
        inputs = []
        for s in verify:
            p = pending[s.req.request_id]
            g, committed = len(p.tokens), s.token_ids
            all_rows = s.req.decode.mode in ("speculative", "rollback")
            suffix = self.target.sync(s.req.request_id, committed + p.tokens, keep_at_most=len(committed) - 1)
            n = len(suffix)
            inputs.append(SeqInput(s.req.request_id, suffix, logits_at=list(range(n - g - 1, n)) if all_rows else [n - 1]))
        out = self.target.forward(inputs)
        verdicts = {}
        for s, rows in zip(verify, out):
            p = pending[s.req.request_id]
            draft = torch.tensor(p.tokens, dtype=torch.long)
            target_nll = None
            if s.req.decode.mode == "rollback" and p.tokens:
                target_nll = -torch.log_softmax(rows[:-1].float(), -1).gather(1, draft[:, None]).squeeze(1)
            rule_input = RuleInput(
                draft=draft,
                q=torch.stack(p.q) if p.q else None,
                p=warp(rows, s.req.params.warp),
                generator=s.generator,
                target_nll=target_nll,
                rollback_nll=s.req.decode.rollback_nll,
            )
            v = get_rule("filter" if s.req.decode.mode == "ar" else s.req.decode.mode)(rule_input)
            verdicts[s.req.request_id] = (v.accepted, v.next_token)
            s.stats.target_calls += 1
        return verdicts

    def _adapt(self, s: RequestState, accepted: int, proposed: int) -> None:
        if not s.req.decode.adaptive or proposed == 0:
            return
        step = ADAPT_STEP if accepted < proposed else -ADAPT_STEP
        s.set_threshold(min(0.99, max(0.0, s.threshold + step)))

    def _release(self, request_id: Hashable) -> None:
        self.target.release(request_id)
        self.trees.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)
