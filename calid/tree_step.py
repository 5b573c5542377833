"""The tree step of calid.Engine: token trees (LLMCad-style) and Lookahead.

Per request: build a deterministic draft tree (from the draft model: a main
branch plus the next-best tokens wherever the draft is unsure; or from the
Lookahead trie), verify it in one batched target forward under a tree mask,
keep the longest branch the target agrees with, and compact the target's KV
cache to that branch so the cache stays a plain sequence.
"""
from __future__ import annotations

from typing import Hashable

import torch

from calid.decoding.confidence import top1
from calid.decoding.lookahead import LookaheadConfig, LookaheadTrie
from calid.decoding.tree import TokenTree, TreeVerdict, verify_greedy, verify_sampled
from calid.decoding.sampling import warp
from calid.generation import RequestState
from calid.runtime.runner import ModelRunner, SeqInput


BRANCH_POINTS = 1  # unsure positions a chain branches at before it stops growing


class TreeStepper:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, lookahead: LookaheadConfig,
                 shared_trie: bool = True):
        self.target, self.draft = target, draft
        self.lookahead_cfg = lookahead
        self.shared_trie = shared_trie
        self._global = LookaheadTrie(lookahead)
        self._tries: dict[Hashable, LookaheadTrie] = {}
        self._lanes: dict[Hashable, int] = {}  # draft chains per tree request, to free their caches

    # ---- lookahead trie lifecycle ------------------------------------------------

    def trie(self, request_id: Hashable) -> LookaheadTrie:
        if self.shared_trie:
            return self._global
        return self._tries.setdefault(request_id, LookaheadTrie(self.lookahead_cfg))

    def admit(self, s: RequestState) -> None:
        if s.req.decode.mode == "lookahead":
            self.trie(s.req.request_id).put_prompt(s.req.request_id, s.req.prompt_ids)

    def release(self, request_id: Hashable) -> None:
        for chain in range(1, self._lanes.pop(request_id, 1)):
            self.draft.release(self._lane_id(request_id, chain))
        if self.shared_trie:
            self._global.eliminate(request_id)
        else:
            self._tries.pop(request_id, None)

    def record(self, s: RequestState, new: int) -> None:
        if s.req.decode.mode == "lookahead":
            self.trie(s.req.request_id).put_output(s.token_ids, new)

    # ---- one step ---------------------------------------------------------------

    def step(self, reqs: list[RequestState], budgets: dict) -> dict[Hashable, tuple[TokenTree, TreeVerdict]]:
        trees = {s.req.request_id: self._build(s, budgets[s.req.request_id]) for s in reqs}
        self._draft_trees([s for s in reqs if s.req.decode.mode == "tree"], trees, budgets)
        return self._verify(reqs, trees)

    def _build(self, s: RequestState, budget: int) -> TokenTree:
        if s.req.decode.mode == "lookahead" and budget > 0:
            return self.trie(s.req.request_id).retrieve(s.token_ids, budget=min(budget, s.req.decode.gamma))
        return TokenTree()

    def _draft_trees(self, reqs: list[RequestState], trees: dict, budgets: dict) -> None:
        """Draft every request's tree, one batched draft forward per depth over all chains.

        Chain 0 follows the draft's top-1 and, where the draft is unsure, adds the
        next-best tokens as sibling leaves (LLMCad); after ``BRANCH_POINTS`` unsure
        positions a chain stops, as the dynamic-length chain does (deeper tokens
        are rarely accepted, and drafting them is not free). Chain j > 0 opens with the
        j-th best token of chain 0's first row and then follows its own top-1;
        chains are merged by common prefix as they grow (SpecInfer).
        """
        lanes = []  # [request, chain index, tip node, unsure positions so far]
        for s in reqs:
            if min(s.req.decode.gamma, budgets[s.req.request_id]) > 0:
                lanes.append([s, 0, -1, 0])
                self._lanes[s.req.request_id] = s.req.decode.tree_chains
        while lanes:
            inputs = []
            for s, j, tip, _ in lanes:
                tree = trees[s.req.request_id]
                chain = [tree.tokens[i] for i in tree.path(tip)] if tip >= 0 else []
                lane_id = self._lane_id(s.req.request_id, j)
                inputs.append(SeqInput(lane_id, self.draft.sync(lane_id, s.token_ids + chain)))
            rows = torch.cat(self.draft.forward(inputs))  # [lanes, V]
            _, nll = top1(rows)
            still = []
            for (s, j, tip, unsure_so_far), row, row_nll in zip(lanes, rows, nll.tolist()):
                tree, decode = trees[s.req.request_id], s.req.decode
                unsure = row_nll > s.confidence.nll
                best = torch.topk(row, max(decode.tree_chains, decode.tree_width if unsure else 1)).indices.tolist()
                new_tip = tree.add(best[0], tip)
                if j == 0:
                    for alt in best[1 : decode.tree_width] if unsure else ():
                        tree.add(alt, tip)
                    if tip < 0:  # the other chains open with the next-best first tokens
                        still += [[s, c, tree.add(best[c], -1), 0] for c in range(1, decode.tree_chains)]
                s.stats.draft_calls += 1
                if unsure_so_far + unsure < BRANCH_POINTS:
                    still.append([s, j, new_tip, unsure_so_far + unsure])
            lanes = [lane for lane in still if trees[lane[0].req.request_id].depth[lane[2]]
                     < min(lane[0].req.decode.gamma, budgets[lane[0].req.request_id])]

    @staticmethod
    def _lane_id(request_id: Hashable, chain: int) -> Hashable:
        return request_id if chain == 0 else (request_id, "chain", chain)

    def _verify(self, reqs: list[RequestState], trees: dict) -> dict:
        inputs, prefix = [], {}
        for s in reqs:
            rid, tree, committed = s.req.request_id, trees[s.req.request_id], s.token_ids
            suffix = self.target.sync(rid, committed + tree.tokens, keep_at_most=len(committed) - 1)
            c = len(suffix) - len(tree)  # committed tokens fed again, the root last
            prefix[rid] = c
            start = len(committed) - c
            positions = list(range(start, len(committed))) + [len(committed) - 1 + d for d in tree.depth]
            inputs.append(SeqInput(rid, committed[start:] + tree.tokens, positions=positions,
                                   ancestors=tree.block_mask(c), logits_at=list(range(c - 1, c + len(tree)))))
        out = self.target.forward(inputs)
        verdicts = {}
        for s, rows in zip(reqs, out):
            rid, tree = s.req.request_id, trees[s.req.request_id]
            if s.req.params.temperature == 0:
                verdict = verify_greedy(tree, rows.argmax(-1).tolist())
            else:
                verdict = verify_sampled(tree, warp(rows, s.req.params.warp), s.generator)
            committed = len(s.token_ids)
            self.target.compact(rid, [committed + i for i in verdict.path], start=committed)
            verdicts[rid] = (tree, verdict)
            s.stats.target_calls += 1
        return verdicts
