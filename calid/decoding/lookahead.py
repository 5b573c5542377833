"""Lookahead: model-free drafts retrieved from a trie of token n-grams.

The trie stores every n-gram (up to ``branch_length`` tokens) of the prompts
and of the generated outputs, each node counting how often its path was seen.
Prompt n-grams are weighted up and *owned* by their live request: they are
removed again when the request finishes (``eliminate``), and pruning never
touches them. When the trie holds more than ``capacity`` nodes, the least
frequent unowned leaves are pruned (``capacity`` defaults to 16 x decoding length).

Retrieval is multi-stage: follow the last ``max_prefix`` tokens of the context
into the trie; if that finds fewer than ``decoding_length / 2`` draft tokens,
shorten the prefix and try again, keeping the largest draft. A draft is a
:class:`~calid.decoding.tree.TokenTree` of at most ``decoding_length`` nodes:
hierarchical (prefixes merged, expanded best-frequency-first) or parallel
(the most frequent whole branches, side by side).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Hashable

from calid.decoding.tree import TokenTree


class _Node:
    __slots__ = ("children", "freq", "owners")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.freq = 0.0
        self.owners = 0  # live prompts whose n-grams pass through this node


@dataclass(frozen=True)
class LookaheadConfig:
    decoding_length: int = 16  # most draft tokens (tree nodes) per step
    branch_length: int = 8  # longest n-gram stored
    max_prefix: int = 4  # longest context suffix used for retrieval
    prompt_weight: float = 2.0
    capacity_factor: int = 16
    parallel: bool = False  # parallel multi-branch instead of hierarchical

    @property
    def capacity(self) -> int:
        return self.capacity_factor * self.decoding_length


class LookaheadTrie:
    def __init__(self, config: LookaheadConfig = LookaheadConfig()):
        self.cfg = config
        self.root = _Node()
        self.size = 0
        self.owned = 0  # nodes some live prompt owns (never pruned)
        self._prompts: dict[Hashable, list[int]] = {}

    # ---- insertion ------------------------------------------------------------

    def _insert(self, ngram: list[int], weight: float, own: int) -> None:
        node = self.root
        for token in ngram:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.size += 1
            was_owned = child.owners > 0
            child.freq += weight
            child.owners += own
            self.owned += (child.owners > 0) - was_owned
            node = child

    def _windows(self, ids: list[int], starts) -> list[list[int]]:
        return [ids[a : a + self.cfg.branch_length] for a in starts if len(ids) - a >= 2]

    def put_prompt(self, owner: Hashable, ids: list[int]) -> None:
        """Insert a request's prompt n-grams, weighted up and owned until ``eliminate(owner)``."""
        self._prompts[owner] = list(ids)
        for w in self._windows(ids, range(len(ids))):
            self._insert(w, self.cfg.prompt_weight, 1)

    def put_output(self, ids: list[int], new: int) -> None:
        """After ``new`` tokens were appended to ``ids``: insert the n-grams they completed."""
        bl = self.cfg.branch_length
        first = max(0, len(ids) - new - bl + 1)
        for w in self._windows(ids, range(first, len(ids) - bl + 1)):
            self._insert(w, 1.0, 0)
        self.prune()

    def eliminate(self, owner: Hashable) -> None:
        """Drop a finished request's prompt n-grams (nodes left with no count disappear)."""
        ids = self._prompts.pop(owner, None)
        if ids is None:
            return
        for w in self._windows(ids, range(len(ids))):
            self._insert(w, -self.cfg.prompt_weight, -1)
        self._drop_empty(self.root)

    def _drop_empty(self, node: _Node) -> None:
        for token, child in list(node.children.items()):
            if child.freq <= 1e-9 and child.owners == 0:
                self.size -= self._count(child)
                del node.children[token]
            else:
                self._drop_empty(child)

    def _count(self, node: _Node) -> int:
        return 1 + sum(self._count(c) for c in node.children.values())

    def prune(self) -> None:
        """Remove the least frequent unowned leaves until the trie fits its capacity."""
        while self.size > self.cfg.capacity and self.size > self.owned:
            leaves = []
            stack = [(self.root, None, None)]
            while stack:
                node, parent, token = stack.pop()
                if not node.children and parent is not None and node.owners == 0:
                    leaves.append((node.freq, id(node), parent, token))
                stack.extend((c, node, t) for t, c in node.children.items())
            if not leaves:
                return  # everything left belongs to live prompts
            leaves.sort(key=lambda x: x[:2])
            for _, _, parent, token in leaves[: self.size - self.cfg.capacity]:
                del parent.children[token]
                self.size -= 1

    # ---- retrieval ------------------------------------------------------------

    def _follow(self, tokens: list[int]) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def retrieve(self, context: list[int], budget: int | None = None) -> TokenTree:
        """Draft tree for what follows ``context`` (empty when nothing matches)."""
        budget = min(budget or self.cfg.decoding_length, self.cfg.decoding_length)
        best = TokenTree()
        for plen in range(min(self.cfg.max_prefix, len(context)), 0, -1):
            node = self._follow(context[-plen:])
            if node is None or not node.children:
                continue
            tree = self._parallel(node, budget) if self.cfg.parallel else self._hierarchical(node, budget)
            if len(tree) > len(best):
                best = tree
            if len(best) >= budget // 2:
                break
        return best

    def _hierarchical(self, start: _Node, budget: int) -> TokenTree:
        tree, tie = TokenTree(), itertools.count()
        heap = [(-c.freq, next(tie), t, c, -1) for t, c in start.children.items()]
        heapq.heapify(heap)
        while heap and len(tree) < budget:
            _, _, token, node, parent = heapq.heappop(heap)
            idx = tree.add(token, parent)
            for t, c in node.children.items():
                heapq.heappush(heap, (-c.freq, next(tie), t, c, idx))
        return tree

    def _parallel(self, start: _Node, budget: int) -> TokenTree:
        branches = []  # (freq of the leaf, path)
        stack = [(start, [])]
        while stack:
            node, path = stack.pop()
            if not node.children and path:
                branches.append((node.freq, path))
            for t, c in node.children.items():
                stack.append((c, path + [t]))
        branches.sort(key=lambda b: -b[0])
        tree = TokenTree()
        for _, path in branches:
            if len(tree) + len(path) > budget:
                break
            parent = -1
            for i, t in enumerate(path):  # branches side by side: never merged at the root
                parent = tree.add(t, parent, merge=i > 0)
        return tree
