"""Token-tree masks as llama.cpp sequence membership: exact sets, and refusal of what sequences cannot express."""
import numpy as np
import pytest

from calid.decoding.tree import TokenTree
from calid.runtime.seq_cover import UnrepresentableMask, cover


def _tree() -> TokenTree:
    # root -> 1 -> 2 -> 3 ; 1 -> 4 ; root -> 5
    t = TokenTree()
    a = t.add(1, -1)
    b = t.add(2, a)
    t.add(3, b)
    t.add(4, a)
    t.add(5, -1)
    return t


def test_tree_with_committed_prefix_is_covered_exactly():
    tree, c = _tree(), 2  # two committed tokens fed before the nodes
    mask = tree.block_mask(c).numpy()
    positions = np.array([10, 11] + [11 + d for d in tree.depth])
    cov = cover(mask, positions)
    assert cov.branches == 3  # leaves: node 3, node 4, node 5
    # committed tokens belong to every branch; node 1 (index c+0) to the two branches through it
    assert cov.member[:c].all()
    assert cov.member[c + 0].tolist() == [True, True, False]
    assert cov.member[c + 1].tolist() == [True, False, False]  # node 2 only on branch of leaf 3
    assert cov.member[c + 3].tolist() == [False, True, False]  # leaf 4
    assert cov.member[c + 4].tolist() == [False, False, True]  # leaf 5
    assert cov.query.tolist() == [0, 0, 0, 0, 0, 1, 2]


def test_plain_causal_chain_is_one_branch():
    mask = np.tril(np.ones((4, 4), dtype=bool))
    cov = cover(mask, np.arange(4))
    assert cov.branches == 1 and cov.member.all()


def test_a_child_at_its_parent_position_is_refused():
    tree = _tree()
    mask = tree.block_mask(1).numpy()
    positions = np.array([5] + [5 + d for d in tree.depth])
    assert cover(mask, positions).branches == 3
    bad = positions.copy()
    bad[1 + 1] = bad[1 + 0]  # node 2 at node 1's position: node 1 would see its own child
    with pytest.raises(UnrepresentableMask, match="would see"):
        cover(mask, bad)


def test_a_mask_that_is_not_a_tree_is_refused():
    mask = np.eye(3, dtype=bool)
    mask[2, 0] = mask[2, 1] = True  # token 2 sees two unrelated tokens 0 and 1: a DAG, not a tree
    with pytest.raises(UnrepresentableMask):
        cover(mask, np.array([0, 0, 1]))
    with pytest.raises(UnrepresentableMask, match="itself"):
        cover(np.zeros((2, 2), dtype=bool), np.arange(2))
