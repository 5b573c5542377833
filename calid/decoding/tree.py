"""Token trees (SpecInfer, LLMCad) as plain arrays, and their verification.

A tree hangs below the *root*: the last committed token. Nodes are numbered
0..n-1 with every parent before its children. Arrays:

  tokens[i]   token id of node i
  parent[i]   index of node i's parent, -1 when its parent is the root
  depth[i]    1 for children of the root, parent's depth + 1 otherwise

The target verifies a tree in one forward over ``[root] + tokens``: the root
at position L-1 (L = committed length) and node i at position L-1+depth[i],
under the mask ``with_root_mask()`` (each token sees the root, its ancestors
and itself). Row 0 of the logits is the target's distribution after the root,
row i+1 its distribution after node i.

Verification walks down from the root (terms as in acceptance.py): a child is
*accepted* when the target agrees with it; the walk ends with a *recovered*
token (no child accepted) or a *bonus* token (a leaf was reached).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from calid.decoding.sampling import sample


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, merge: bool = True) -> int:
        """Append a node; with ``merge`` return the existing child of ``parent`` with this token instead.

        Stochastic trees must not merge: each i.i.d. draft draw is its own child,
        because multi-step speculative sampling updates the residual once per draw.
        """
        for i in self.children(parent) if merge else ():
            if self.tokens[i] == token:
                return i
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parent) if p == node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    @classmethod
    def from_chains(cls, chains: list[list[int]], budget: int | None = None) -> "TokenTree":
        """Merge draft sequences by common prefix (SpecInfer), keeping at most ``budget`` nodes."""
        tree = cls()
        for chain in chains:
            node = -1
            for token in chain:
                existing = [i for i in tree.children(node) if tree.tokens[i] == token]
                if not existing and budget is not None and len(tree) >= budget:
                    break
                node = tree.add(token, node)
        return tree

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool, device="cpu")  # masks are built on the host; runners move them
        for i in range(n):
            for j in self.path(i):
                mask[i, j] = True
        return mask

    def with_root_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool for the verify forward over [root] + nodes."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device="cpu")
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask()
        return mask

    def block_mask(self, prefix: int) -> torch.Tensor:
        """[prefix+n, prefix+n] bool for a forward over ``prefix`` committed tokens then the nodes.

        The committed tokens are causal among themselves; every node sees all of
        them, its ancestors and itself. ``block_mask(1)`` is ``with_root_mask()``.
        """
        n = len(self)
        mask = torch.zeros(prefix + n, prefix + n, dtype=torch.bool, device="cpu")
        mask[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool, device="cpu").tril()
        mask[prefix:, :prefix] = True
        mask[prefix:, prefix:] = self.ancestor_mask()
        return mask

    def leaves(self) -> list[int]:
        """Nodes without children, in depth-first order with children in index order: the first is the end
        of the first-child chain (a draft's top-1 chain, a trie's most frequent branch)."""
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parent):
            kids.setdefault(p, []).append(i)
        out, stack = [], kids.get(-1, [])[::-1]
        while stack:
            node = stack.pop()
            if node in kids:
                stack += kids[node][::-1]
            else:
                out.append(node)
        return out

    def pruned(self, branches: int) -> tuple["TokenTree", list[int]]:
        """The subtree of this tree's first ``branches`` root-to-leaf paths (``leaves()`` order), and the old
        index of each kept node (in order; index a per-node array with it). Verifying a pruned tree is
        still exact: every verification here accepts only along verified nodes, whatever the tree."""
        if branches < 1:
            raise ValueError(f"a tree keeps at least one branch, not {branches}")
        kept = sorted({n for leaf in self.leaves()[:branches] for n in self.path(leaf)})
        new_of = {old: new for new, old in enumerate(kept)}
        tree = TokenTree()
        for old in kept:
            tree.tokens.append(self.tokens[old])
            tree.parent.append(new_of.get(self.parent[old], -1))
            tree.depth.append(self.depth[old])
        return tree, kept

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    def positions(self, committed: int) -> list[int]:
        """RoPE positions of [root] + nodes when ``committed`` tokens precede (the root is the last)."""
        return [committed - 1] + [committed - 1 + d for d in self.depth]


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root's child first
    next_token: int  # recovered or bonus token from the target


def verify_greedy(tree: TokenTree, target_argmax: list[int]) -> TreeVerdict:
    """VerifyGreedy. ``target_argmax[r]`` = target's top token at row r (0 = root, i+1 = node i)."""
    node, path = -1, []
    while True:
        want = target_argmax[node + 1]
        match = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if match is None:
            return TreeVerdict(path, want)
        path.append(match)
        node = match


def verify_sampled(tree: TokenTree, p: torch.Tensor, generator=None) -> TreeVerdict:
    """Exact verification of a *deterministic* tree (top-k or trie branches) under sampling.

    p [n+1, V] by row as in verify_greedy. At a node the distinct children are
    tried in order: child x is accepted with probability r(x) / sum(r), where r
    starts as p and loses each rejected child's token (sampling without
    replacement), so every token is emitted with exactly its probability under p.
    """
    node, path = -1, []
    while True:
        residual = p[node + 1].clone()
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            total = float(residual.sum())
            if total > 0 and float(torch.rand(1, generator=generator, device=p.device)) * total < float(residual[x]):
                accepted = child
                break
            residual[x] = 0.0
        if accepted is None:
            dist = residual if float(residual.sum()) > 0 else p[node + 1]
            return TreeVerdict(path, int(sample(dist[None] / dist.sum(), generator)[0]))
        path.append(accepted)
        node = accepted


def verify_stochastic(tree: TokenTree, p: torch.Tensor, q: torch.Tensor, generator=None) -> TreeVerdict:
    """VerifyStochastic (SpecInfer multi-step speculative sampling).

    p [n+1, V]: target distributions by row (0 = root, i+1 = node i).
    q [n+1, V]: the draft distribution each node's *children* were drawn from, by the same rows;
    children of one node must be independent draws from that row of q, duplicates kept
    as separate children (``TokenTree.add(..., merge=False)``).
    At a node, children are tried in order: accept child x with probability
    min(1, p'(x) / q(x)); on rejection p' <- norm(max(0, p' - q)). If no child
    is accepted the recovered token is drawn from p'; at a leaf the bonus from p.
    """
    node, path = -1, []
    while True:
        row = node + 1
        residual = p[row].clone()
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            u = float(torch.rand(1, generator=generator, device=p.device))
            if u * float(q[row, x]) < float(residual[x]):
                accepted = child
                break
            residual = (residual - q[row]).clamp_min(0.0)
            total = residual.sum()
            residual = residual / total if total > 0 else p[row].clone()
        if accepted is None:
            return TreeVerdict(path, int(sample(residual[None], generator)[0]))
        path.append(accepted)
        node = accepted
