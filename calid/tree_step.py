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


class TreeStepper:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, lookahead: LookaheadConfig,
                 shared_trie: bool = True):
        self.target, self.draft = target, draft
        self.lookahead_cfg = lookahead
        self.shared_trie = shared_trie
        self._global = LookaheadTrie(lookahead)
        self._tries: dict[Hashable, LookaheadTrie] = {}

    # ---- lookahead trie lifecycle ------------------------------------------------

    def trie(self, request_id: Hashable) -> LookaheadTrie:
        if self.shared_trie:
            return self._global
        return self._tries.setdefault(request_id, LookaheadTrie(self.lookahead_cfg))

    def admit(self, s: RequestState) -> None:
        if s.req.decode.mode == "lookahead":
            self.trie(s.req.request_id).put_prompt(s.req.request_id, s.req.prompt_ids)

    def release(self, request_id: Hashable) -> None:
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
        """Main branch by the draft's top-1; at unconfident positions add the next-best tokens as siblings."""
        tips = {s.req.request_id: -1 for s in reqs}
        live = [s for s in reqs if min(s.req.decode.gamma, budgets[s.req.request_id]) > 0]
        while live:
            inputs = []
            for s in live:
                tree = trees[s.req.request_id]
                chain = [tree.tokens[i] for i in tree.path(tips[s.req.request_id])] if tree.tokens else []
                inputs.append(SeqInput(s.req.request_id, self.draft.sync(s.req.request_id, s.token_ids + chain)))
            rows = torch.cat(self.draft.forward(inputs))  # [B, V]
            _, nll = top1(rows)
            still = []
            for s, row, row_nll in zip(live, rows, nll.tolist()):
                rid, tree = s.req.request_id, trees[s.req.request_id]
                width = s.req.decode.tree_width if row_nll > s.confidence.nll else 1
                best = torch.topk(row, width).indices.tolist()
                parent = tips[rid]
                tips[rid] = tree.add(best[0], parent)
                for alt in best[1:]:
                    tree.add(alt, parent)
                s.stats.draft_calls += 1
                if tree.max_depth < min(s.req.decode.gamma, budgets[rid]):
                    still.append(s)
            live = still

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
