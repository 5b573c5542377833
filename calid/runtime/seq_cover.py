"""Express a token tree's ancestor mask as llama.cpp sequence membership, exactly.

llama.cpp masks attention by sequence membership and position: a query token
of sequence ``s`` at position ``p`` sees every cached cell that belongs to
``s`` and sits at a position ``<= p``. A KV cell may belong to several
sequences, and a query uses the first sequence id of its token.

A token tree maps onto that with one sequence per *branch* (root-to-leaf
path): every node belongs to the branches of all leaves below it, and queries
with the branch of its first leaf. Node ``i`` then sees exactly the nodes of
that branch at positions ``<= pos[i]``: its ancestors and itself, provided
positions grow by one per level (tree depth). ``cover`` builds this and checks
it against the requested mask, so a mask that sequences cannot express
(anything but a forest of chains) is refused instead of silently approximated.

Terms:
  ancestors  bool [q, q]: ancestors[i, j] is True when new token i may attend new token j
  leaves     tokens no other token attends to, one branch (sequence) each
  member     bool [q, n_leaves]: token i belongs to branch k
  query      [q]: the branch whose sequence id token i queries with
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class UnrepresentableMask(ValueError):
    """The mask is not a forest of chains with depth positions; llama.cpp sequences cannot express it."""


@dataclass
class Cover:
    member: np.ndarray  # [q, n_leaves] bool
    query: np.ndarray  # [q] int, branch index of each token's query sequence

    @property
    def branches(self) -> int:
        return self.member.shape[1]


def cover(ancestors: np.ndarray, positions: np.ndarray) -> Cover:
    """Branch membership for ``ancestors`` [q, q] (with the diagonal) at ``positions`` [q]; exact or raises."""
    a = np.asarray(ancestors, dtype=bool)
    pos = np.asarray(positions)
    q = a.shape[0]
    if a.shape != (q, q) or pos.shape != (q,):
        raise UnrepresentableMask(f"mask {a.shape} and positions {pos.shape} do not match")
    if not a.diagonal().all():
        raise UnrepresentableMask("every token must attend to itself")
    attended_by_other = (a & ~np.eye(q, dtype=bool)).any(axis=0)  # [q]
    leaves = np.flatnonzero(~attended_by_other)
    member = a[leaves].T.copy()  # token j belongs to branch k when leaf k attends j
    query = member.argmax(axis=1)  # first branch holding the token
    implied = member[:, query].T & (pos[None, :] <= pos[:, None])  # [q, q]: what llama.cpp would let i see
    if not np.array_equal(implied, a):
        bad = np.argwhere(implied != a)[0]
        raise UnrepresentableMask(
            f"token {bad[0]} would {'see' if implied[tuple(bad)] else 'miss'} token {bad[1]}: "
            "the mask is not a tree of chains with one position per level")
    return Cover(member, query)
