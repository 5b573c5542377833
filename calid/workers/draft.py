"""The draft worker: extends many requests' drafts, one batched draft forward per depth.

Chain modes grow one chain per request, each token the draft's top-1 (or a
sample of it):
  filter       to its budget (or EOS, or a token below STOP_THRESHOLD); the
               positions where the draft was unsure are listed, and at each the
               target decides (calid.workers.target);
  speculative, rollback  until an unconfident token, kept as the chain's last
               (dynamic draft length), or the budget.
Tree mode grows an LLMCad/SpecInfer tree (``_draft_trees``).
"""
from __future__ import annotations

import math
from typing import Hashable

import torch

from calid.decoding.confidence import top1
from calid.decoding.grammar import GrammarMasks, constrain
from calid.decoding.modes import STOP_THRESHOLD
from calid.decoding.sampling import argmax_rows, sample, warp
from calid.decoding.tree import TokenTree
from calid.runtime.runner import ModelRunner, SeqInput
from calid.runtime.twins import twin_key
from calid.workers.messages import (DraftResult, DraftTask, grammar_entry, load_generator, require_full_ids,
                                   save_generator)
from calid.workers.target import MIN_CHUNK

BRANCH_POINTS = 1  # unsure positions a tree chain branches at before it stops growing
# filter: a chain drafts on past an unsure token unless the draft's top-1 is below STOP_THRESHOLD there, where the
# target seldom picks it and what was drafted after it would be thrown away (2-core Xeon, 8 mix requests at 4 slots,
# t=0.95: 0.4 kept 65% of the tokens verified after an unsure one, no stop 39%; 0.7 and 0.9 no faster)
FILTER_STOP_NLL = -math.log(STOP_THRESHOLD)


class _Chain:
    def __init__(self, task: DraftTask, eos_ids: frozenset[int], device: torch.device):
        self.task = task
        self.generator = load_generator(task.rng, device)
        self.tokens: list[int] = []
        self.q: list[torch.Tensor] = []
        self.probs: list[float] = []
        self.unsure: list[int] = []  # filter: indices of tokens the draft was unsure of (the target decides them)
        self.done = task.budget == 0
        self.needs_target = task.decode.mode != "filter" or self.done
        self.forwards = 0
        self.eos_ids = eos_ids

    def extend(self, row: torch.Tensor | None, nll: float, top: int) -> None:
        """One draft position: ``row`` its logits (None where the runner gave only ``top`` and ``nll``: a
        greedy chain reads nothing else), ``top`` their argmax and ``nll`` its -log softmax."""
        t = self.task
        self.forwards += 1
        confident = nll <= t.confidence_nll
        filtering = t.decode.mode == "filter"
        if filtering and not confident:  # the target decides this token; the chain goes on from the draft's best
            self.unsure.append(len(self.tokens))  # guess, which is the target's token most of the time, so the
            self.needs_target = True  # tokens after it are decided in the same target call (batches stay full)
        if t.warp.greedy or (filtering and not confident):  # the argmax, with no distribution over the vocabulary
            token = top
        else:
            q = warp(row[None], t.warp)[0]
            token = int(sample(q[None], self.generator)[0])
            if not filtering:  # filter's target never weighs q
                self.q.append(q)
        self.tokens.append(token)
        self.probs.append(math.exp(-nll))
        if (not confident and (not filtering or nll > FILTER_STOP_NLL)) or len(self.tokens) >= t.budget \
                or token in self.eos_ids:
            self.done = True

    def result(self) -> DraftResult:
        return DraftResult(self.task.request_id, self.tokens, torch.stack(self.q) if self.q else None,
                           self.needs_target, None, self.forwards, save_generator(self.generator),
                           self.probs, self.unsure)


class DraftWorker:
    """Drafts with ``runner``; tree requests also merge one chain from each of the ``extra`` drafters.

    Several drafters (e.g. a small sibling model and a self-draft of the target)
    propose different continuations; SpecInfer merges them into one token tree
    by common prefix, so one verification pass tries all of them.
    """

    def __init__(self, runner: ModelRunner, eos_ids: frozenset[int], extra: list[ModelRunner] | tuple = (),
                 max_forward_tokens: int | None = None, grammar: GrammarMasks | None = None):
        self.runner = runner
        self.grammar = grammar  # structured output: each request's grammar cursor (None: none served)
        self.max_forward_tokens = max_forward_tokens  # prompts longer than this are prefilled in chunks
        self.eos_ids = eos_ids
        self.extra = list(extra)
        self._lanes: dict[Hashable, int] = {}  # draft chains per tree request, to free their caches

    def draft(self, tasks: list[DraftTask]) -> list[DraftResult]:
        require_full_ids(tasks)
        groups = _fitting(tasks, self.runner.max_sequences)
        if len(groups) > 1:  # more lanes than the runner holds at once: one draft per group that fits
            return [r for group in groups for r in self.draft(group)]
        order, prefilling = tasks, self._prefill_chunks(tasks)
        tasks = [t for t in tasks if t.request_id not in prefilling]
        chains = [_Chain(t, self.eos_ids, self.runner.device) for t in tasks if not t.decode.is_tree]
        self._draft_chains(chains)
        tree_tasks = [t for t in tasks if t.decode.mode == "tree"]
        stochastic = [t for t in tree_tasks if _stochastic(t)]
        trees = self._draft_trees([t for t in tree_tasks if not _stochastic(t)]) | self._draft_stochastic(stochastic)
        by_id = {c.task.request_id: c.result() for c in chains} | trees | prefilling
        return [by_id[t.request_id] for t in order if t.request_id in by_id]

    def _prefill_chunks(self, tasks: list[DraftTask]) -> dict[Hashable, DraftResult]:
        """SARATHI on the draft, as on the target: short work (decode steps) always runs, then prompts that
        fit the forward's token budget; a prompt that does not gets its next chunk fed here and drafts
        nothing this step: its result says ``catching_up`` (a lossless request's target decodes alone
        meanwhile; a filter request waits). The forward stays within the budget (given one of at least
        MIN_CHUNK tokens)."""
        if self.max_forward_tokens is None:
            return {}
        pending = {t.request_id: len(self.runner.sync(t.request_id, t.token_ids)) for t in tasks}
        left = self.max_forward_tokens - sum(n for n in pending.values() if n <= MIN_CHUNK)
        out, inputs, planned = {}, [], {}  # planned: a twin's chunk (calid.runtime.twins)
        for t in tasks:
            n = pending[t.request_id]
            if n <= MIN_CHUNK:
                continue
            key = twin_key(t.token_ids, n)
            if key in planned:  # the runner feeds its twin's work once: the same chunk, no more of the budget
                chunk = planned[key]
            elif n <= left:
                left -= n
                chunk = None
            elif left < MIN_CHUNK and inputs:  # the budget is spent: this prompt waits for the next step
                chunk = 0
            else:
                chunk = min(n - 1, max(left, MIN_CHUNK))
                left = max(0, left - chunk)
            planned[key] = chunk
            if chunk is None:  # the whole prompt fits
                continue
            out[t.request_id] = DraftResult(t.request_id, [], None, True, None, int(chunk > 0), t.rng,
                                            catching_up=True)
            if chunk:
                inputs.append(SeqInput(t.request_id, self.runner.sync(t.request_id, t.token_ids)[:chunk]))
        if inputs:
            self.runner.forward(inputs)
        return out

    def release(self, request_ids: list[Hashable]) -> None:
        for rid in request_ids:
            self.runner.release(rid)
            if self.grammar is not None:
                self.grammar.release(rid)
            for chain in range(1, self._lanes.pop(rid, 1)):
                self.runner.release(_lane_id(rid, chain))
            for k, runner in enumerate(self.extra):
                runner.release(_extra_lane(rid, k))

    def _draft_chains(self, chains: list[_Chain]) -> None:
        while live := [c for c in chains if not c.done]:
            inputs = [SeqInput(c.task.request_id, self.runner.sync(c.task.request_id, c.task.token_ids + c.tokens),
                               reads="top1_nll" if c.task.warp.greedy and c.task.warp.grammar is None else "rows")
                      for c in live]
            out = self.runner.forward(inputs)
            full = [i for i, o in enumerate(out) if not isinstance(o, list)]  # rows, not (top, nll) pairs
            picked = {}
            if full:
                rows = constrain(self.grammar, torch.cat([out[i] for i in full]),  # [B, V]
                                 [grammar_entry(live[i].task, live[i].tokens) for i in full])
                best, nll = top1(rows)  # [B], [B]
                picked = {i: (row, row_nll, top) for i, row, row_nll, top in zip(full, rows, nll.tolist(),
                                                                                  best.tolist())}
            for i, c in enumerate(live):
                if i in picked:
                    c.extend(*picked[i])
                else:
                    (top, row_nll), = out[i]
                    c.extend(None, row_nll, top)

    def _draft_trees(self, tasks: list[DraftTask]) -> dict[Hashable, DraftResult]:
        """Draft every request's tree, one batched draft forward per depth over all chains.

        Chain 0 follows the draft's top-1 and, where the draft is unsure, adds the
        next-best tokens as sibling leaves (LLMCad); after ``BRANCH_POINTS`` unsure
        positions a chain stops, as the dynamic-length chain does (deeper tokens
        are rarely accepted, and drafting them is not free). Chain j > 0 opens with the
        j-th best token of chain 0's first row and then follows its own top-1;
        chains are merged by common prefix as they grow (SpecInfer).
        """
        trees = {t.request_id: TokenTree() for t in tasks}
        forwards = {t.request_id: 0 for t in tasks}
        lanes = []  # [task, chain index, tip node, unsure positions so far]
        for t in tasks:
            if min(t.decode.gamma, t.budget) > 0:
                lanes.append([t, 0, -1, 0])
                self._lanes[t.request_id] = t.decode.tree_chains
        while lanes:
            rows, nll = _forward_tips(
                self.runner, self.grammar, [(_lane_id(t.request_id, j), t, tip) for t, j, tip, _ in lanes], trees
            )
            still = []
            for (t, j, tip, unsure_so_far), row, row_nll in zip(lanes, rows, nll.tolist()):
                tree, decode = trees[t.request_id], t.decode
                unsure = row_nll > t.confidence_nll
                top = torch.topk(row, max(decode.tree_chains, decode.tree_width if unsure else 1))
                best = [i for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > -math.inf]
                best = best or top.indices.tolist()[:1]
                new_tip = tree.add(best[0], tip)
                if j == 0:
                    for alt in best[1 : decode.tree_width] if unsure else ():
                        tree.add(alt, tip)
                    if tip < 0:  # the other chains open with the next-best first tokens
                        still += [[t, c, tree.add(best[c], -1), 0] for c in range(1, min(decode.tree_chains,
                                                                                          len(best)))]
                forwards[t.request_id] += 1
                if unsure_so_far + unsure < BRANCH_POINTS:
                    still.append([t, j, new_tip, unsure_so_far + unsure])
            lanes = [lane for lane in still
                     if trees[lane[0].request_id].depth[lane[2]] < min(lane[0].decode.gamma, lane[0].budget)]
        for k, runner in enumerate(self.extra):
            self._merge_extra_chain(runner, self.grammar, k, tasks, trees, forwards)
        return {t.request_id: DraftResult(t.request_id, [], None, True, trees[t.request_id], forwards[t.request_id])
                for t in tasks}


    def _draft_stochastic(self, tasks: list[DraftTask]) -> dict[Hashable, DraftResult]:
        """SpecInfer trees from several samples of one draft, for sampled requests with tree_chains > 1.

        The root gets ``tree_chains`` i.i.d. children drawn from the draft's warped
        distribution q (duplicates kept apart: multi-step speculative sampling
        needs every draw), then each chain grows one sampled token per depth
        until its budget or an unsure step. Returned with the q row each node's
        children were drawn from, for VerifyStochastic.
        """
        out = {}
        trees = {t.request_id: TokenTree() for t in tasks}
        q_rows: dict[Hashable, dict[int, torch.Tensor]] = {t.request_id: {} for t in tasks}
        gens = {t.request_id: load_generator(t.rng, self.runner.device) for t in tasks}
        forwards = {t.request_id: 0 for t in tasks}
        lanes = [(t, 0, -1) for t in tasks if min(t.decode.gamma, t.budget) > 0]  # (task, chain, tip)
        for t in tasks:
            self._lanes[t.request_id] = t.decode.tree_chains
        while lanes:
            rows, nll = _forward_tips(self.runner, self.grammar,
                                      [(_lane_id(t.request_id, j), t, tip) for t, j, tip in lanes], trees)
            still = []
            for (t, j, tip), row, row_nll in zip(lanes, rows, nll.tolist()):
                rid, tree = t.request_id, trees[t.request_id]
                q = warp(row[None], t.warp)[0]
                q_rows[rid][tip + 1] = q
                draws = t.decode.tree_chains if tip < 0 else 1
                tokens = torch.multinomial(q, draws, replacement=True, generator=gens[rid]).tolist()
                forwards[rid] += 1
                for c, token in enumerate(tokens):
                    node = tree.add(token, tip, merge=False)
                    if row_nll <= t.confidence_nll and tree.depth[node] < min(t.decode.gamma, t.budget):
                        still.append((t, j if tip >= 0 else c, node))
            lanes = still
        for t in tasks:
            rid, tree = t.request_id, trees[t.request_id]
            q = torch.zeros(len(tree) + 1, self.runner.vocab_size, device=self.runner.device)  # [n+1, V]
            for row, dist in q_rows[rid].items():
                q[row] = dist
            out[rid] = DraftResult(rid, [], q, True, tree, forwards[rid], save_generator(gens[rid]))
        return out

    @staticmethod
    def _merge_extra_chain(runner: ModelRunner, grammar: GrammarMasks | None, k: int, tasks: list[DraftTask],
                           trees: dict, forwards: dict) -> None:
        """Grow one greedy chain per request with drafter ``k`` (dynamic length), merged into its tree."""
        live = [(t, -1) for t in tasks if min(t.decode.gamma, t.budget) > 0]
        while live:
            lanes = [(_extra_lane(t.request_id, k), t, tip) for t, tip in live]
            rows, nll = _forward_tips(runner, grammar, lanes, trees)
            still = []
            for (t, tip), token, row_nll in zip(live, argmax_rows(rows), nll.tolist()):
                tree = trees[t.request_id]
                node = tree.add(token, tip)  # joins an existing branch when the drafters agree
                forwards[t.request_id] += 1
                if row_nll <= t.confidence_nll and tree.depth[node] < min(t.decode.gamma, t.budget):
                    still.append((t, node))
            live = still


def _forward_tips(runner: ModelRunner, grammar: GrammarMasks | None, lanes: list[tuple], trees: dict
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched forward over lanes ``(lane id, task, tip node)``, each fed its tree path after the
    committed ids; returns the rows after each tip [lanes, V] (masked by the request's grammar) and their
    top-1 NLL [lanes]."""
    inputs, entries = [], []
    for lane, t, tip in lanes:
        tree = trees[t.request_id]
        chain = [tree.tokens[i] for i in tree.path(tip)] if tip >= 0 else []
        inputs.append(SeqInput(lane, runner.sync(lane, t.token_ids + chain)))
        entries.append(grammar_entry(t, chain))
    rows = constrain(grammar, torch.cat(runner.forward(inputs)), entries)
    return rows, top1(rows)[1]


def _fitting(tasks: list[DraftTask], cap: int | None) -> list[list[DraftTask]]:
    """``tasks`` in consecutive groups whose draft lanes (a tree's chains, else one) fit ``cap`` sequences."""
    if cap is None:
        return [tasks]
    groups, lanes = [[]], 0
    for t in tasks:
        need = t.decode.tree_chains if t.decode.mode == "tree" else 1
        if groups[-1] and lanes + need > cap:
            groups.append([])
            lanes = 0
        groups[-1].append(t)
        lanes += need
    return groups


def _stochastic(t: DraftTask) -> bool:
    return not t.warp.greedy and t.decode.tree_chains > 1


def _extra_lane(request_id: Hashable, k: int) -> Hashable:
    return (request_id, "extra", k)


def _lane_id(request_id: Hashable, chain: int) -> Hashable:
    return request_id if chain == 0 else (request_id, "chain", chain)
