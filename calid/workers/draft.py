"""The draft worker: extends many requests' drafts, one batched draft forward per depth.

Chain modes (filter, rollback, speculative) grow one chain per request until
its confidence test fails or its budget is spent (dynamic draft length):
  filter       an unconfident step is not kept: the target generates that token;
  speculative  an unconfident token is kept and ends the chain;
Tree mode grows an LLMCad/SpecInfer tree (``_draft_trees``).
"""
from __future__ import annotations

from typing import Hashable

import torch

from calid.decoding.confidence import top1
from calid.decoding.sampling import sample, warp
from calid.decoding.tree import TokenTree
from calid.runtime.runner import ModelRunner, SeqInput
from calid.workers.messages import DraftResult, DraftTask, load_generator, save_generator

BRANCH_POINTS = 1  # unsure positions a tree chain branches at before it stops growing


class _Chain:
    def __init__(self, task: DraftTask, eos_ids: frozenset[int]):
        self.task = task
        self.generator = load_generator(task.rng)
        self.tokens: list[int] = []
        self.q: list[torch.Tensor] = []
        self.done = task.budget == 0
        self.needs_target = task.decode.mode != "filter" or self.done
        self.forwards = 0
        self.eos_ids = eos_ids

    def extend(self, row: torch.Tensor, nll: float) -> None:
        t = self.task
        self.forwards += 1
        confident = nll <= t.confidence_nll
        if t.decode.mode == "filter" and not confident:
            self.done, self.needs_target = True, True  # the target generates this token
            return
        q = warp(row[None], t.warp)[0]
        token = int(sample(q[None], self.generator)[0])
        self.tokens.append(token)
        if not t.warp.greedy:
            self.q.append(q)
        if not confident or len(self.tokens) >= t.budget or token in self.eos_ids:
            self.done = True

    def result(self) -> DraftResult:
        return DraftResult(self.task.request_id, self.tokens, torch.stack(self.q) if self.q else None,
                           self.needs_target, None, self.forwards, save_generator(self.generator))


class DraftWorker:
    def __init__(self, runner: ModelRunner, eos_ids: frozenset[int]):
        self.runner = runner
        self.eos_ids = eos_ids
        self._lanes: dict[Hashable, int] = {}  # draft chains per tree request, to free their caches

    def draft(self, tasks: list[DraftTask]) -> list[DraftResult]:
        chains = [_Chain(t, self.eos_ids) for t in tasks if not t.decode.is_tree]
        self._draft_chains(chains)
        trees = self._draft_trees([t for t in tasks if t.decode.mode == "tree"])
        by_id = {c.task.request_id: c.result() for c in chains} | trees
        return [by_id[t.request_id] for t in tasks if t.request_id in by_id]

    def release(self, request_ids: list[Hashable]) -> None:
        for rid in request_ids:
            self.runner.release(rid)
            for chain in range(1, self._lanes.pop(rid, 1)):
                self.runner.release(_lane_id(rid, chain))

    def _draft_chains(self, chains: list[_Chain]) -> None:
        while live := [c for c in chains if not c.done]:
            inputs = [SeqInput(c.task.request_id, self.runner.sync(c.task.request_id, c.task.token_ids + c.tokens))
                      for c in live]
            rows = torch.cat(self.runner.forward(inputs))  # [B, V]
            _, nll = top1(rows)  # [B]
            for c, row, row_nll in zip(live, rows, nll.tolist()):
                c.extend(row, row_nll)

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
            inputs = []
            for t, j, tip, _ in lanes:
                tree = trees[t.request_id]
                chain = [tree.tokens[i] for i in tree.path(tip)] if tip >= 0 else []
                lane = _lane_id(t.request_id, j)
                inputs.append(SeqInput(lane, self.runner.sync(lane, t.token_ids + chain)))
            rows = torch.cat(self.runner.forward(inputs))  # [lanes, V]
            _, nll = top1(rows)
            still = []
            for (t, j, tip, unsure_so_far), row, row_nll in zip(lanes, rows, nll.tolist()):
                tree, decode = trees[t.request_id], t.decode
                unsure = row_nll > t.confidence_nll
                best = torch.topk(row, max(decode.tree_chains, decode.tree_width if unsure else 1)).indices.tolist()
                new_tip = tree.add(best[0], tip)
                if j == 0:
                    for alt in best[1 : decode.tree_width] if unsure else ():
                        tree.add(alt, tip)
                    if tip < 0:  # the other chains open with the next-best first tokens
                        still += [[t, c, tree.add(best[c], -1), 0] for c in range(1, decode.tree_chains)]
                forwards[t.request_id] += 1
                if unsure_so_far + unsure < BRANCH_POINTS:
                    still.append([t, j, new_tip, unsure_so_far + unsure])
            lanes = [lane for lane in still
                     if trees[lane[0].request_id].depth[lane[2]] < min(lane[0].decode.gamma, lane[0].budget)]
        return {t.request_id: DraftResult(t.request_id, [], None, True, trees[t.request_id], forwards[t.request_id])
                for t in tasks}


def _lane_id(request_id: Hashable, chain: int) -> Hashable:
    return request_id if chain == 0 else (request_id, "chain", chain)
