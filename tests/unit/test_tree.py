"""Token trees: exact arrays and masks for hand-made trees, and verification."""
import torch

from calid.decoding.sampling import make_generator
from calid.decoding.tree import TokenTree, verify_greedy, verify_stochastic


def two_branches():
    return TokenTree.from_chains([[1, 2, 3], [1, 2, 4]])


def test_branches_share_their_common_prefix():
    t = two_branches()
    assert t.tokens == [1, 2, 3, 4]
    assert t.parent == [-1, 0, 1, 1]
    assert t.depth == [1, 2, 3, 3]
    assert t.positions(committed=10) == [9, 10, 11, 12, 12]


def test_ancestor_mask_is_exact():
    expected = torch.tensor([
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(two_branches().ancestor_mask(), expected)
    with_root = two_branches().with_root_mask()
    assert with_root[:, 0].all() and torch.equal(with_root[1:, 1:], expected) and not with_root[0, 1:].any()


def test_budget_limits_new_nodes():
    t = TokenTree.from_chains([[1, 2, 3], [5, 6], [1, 7]], budget=4)
    assert t.tokens == [1, 2, 3, 5]


def test_verify_greedy_follows_the_target_down_the_right_branch():
    t = two_branches()  # rows: root, n0=1, n1=2, n2=3, n3=4
    assert verify_greedy(t, [1, 2, 4, 9, 8]).path == [0, 1, 3]
    assert verify_greedy(t, [1, 2, 4, 9, 8]).next_token == 8  # bonus after leaf n3
    assert verify_greedy(t, [1, 5, 0, 0, 0]) .path == [0] and verify_greedy(t, [1, 5, 0, 0, 0]).next_token == 5
    assert verify_greedy(t, [6, 0, 0, 0, 0]).path == [] and verify_greedy(t, [6, 0, 0, 0, 0]).next_token == 6


P_TARGET = torch.tensor([0.05, 0.15, 0.2, 0.25, 0.35])
Q_DRAFT = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
CHI2_P001_DF4 = 18.47


def first_token_chi2(merge: bool, seed: int, k: int = 3, n: int = 6000) -> float:
    """k i.i.d. draft children at the root, verified stochastically; chi2 of the first emitted token vs p."""
    V = P_TARGET.numel()
    g = make_generator(seed)
    counts = torch.zeros(V)
    for _ in range(n):
        tree = TokenTree()
        for x in torch.multinomial(Q_DRAFT, k, replacement=True, generator=g).tolist():
            tree.add(x, -1, merge=merge)
        filler = torch.full((len(tree), V), 1 / V)
        v = verify_stochastic(tree, torch.cat([P_TARGET[None], filler]), torch.cat([Q_DRAFT[None], filler]), g)
        counts[tree.tokens[v.path[0]] if v.path else v.next_token] += 1
    expected = P_TARGET * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_verify_stochastic_follows_target_distribution():
    assert first_token_chi2(merge=False, seed=0) < CHI2_P001_DF4


def test_merging_duplicate_draws_would_bias_stochastic_verification():
    """The same check catches the wrong construction (duplicate draws merged into one child)."""
    assert first_token_chi2(merge=True, seed=1) > CHI2_P001_DF4


def test_leaves_come_first_child_chain_first_and_a_pruned_tree_keeps_their_paths():
    t = TokenTree()
    a = t.add(1, -1)        # 0: the top-1 chain 1 -> 2 -> 3
    t.add(7, -1)            # 1: a sibling leaf at depth 1
    b = t.add(2, a)         # 2
    t.add(8, a)             # 3: a sibling leaf at depth 2
    t.add(3, b)             # 4
    assert t.leaves() == [4, 3, 1]
    one, kept = t.pruned(1)
    assert kept == [0, 2, 4] and one.tokens == [1, 2, 3] and one.parent == [-1, 0, 1] and one.depth == [1, 2, 3]
    two, kept = t.pruned(2)
    assert kept == [0, 2, 3, 4] and two.tokens == [1, 2, 8, 3] and two.parent == [-1, 0, 0, 1]
    assert t.pruned(5)[0].tokens == t.tokens
    assert verify_greedy(one, [1, 2, 3, 9]).path == [0, 1, 2]  # indices of the pruned tree


def test_trees_are_cut_to_the_spare_branches_in_task_order_with_their_draft_rows():
    from calid.decoding.modes import DecodeParams
    from calid.decoding.sampling import Warp
    from calid.workers.messages import VerifyTask
    from calid.workers.target import _fit_branches

    def task(rid):
        tree = TokenTree()
        for token in (5, 6, 7):  # three i.i.d. draws below the root, one more below the second
            tree.add(token, -1, merge=False)
        tree.add(8, 1)
        q = torch.arange(5.0)[:, None].expand(5, 3)  # row r holds r: root, then nodes 0..3
        return VerifyTask(rid, [1, 2], 2, DecodeParams(mode="tree"), Warp(), 4, [], q=q, tree=tree)

    tasks = [task("a"), task("b"), task("c")]
    trees = {t.request_id: t.tree for t in tasks}
    out = _fit_branches(tasks, trees, spare=3)
    assert len(trees["a"].leaves()) == 3 and out[0] is tasks[0]  # first in order: all its branches
    assert trees["b"].tokens == [5, 6, 8] and out[1].q[:, 0].tolist() == [0, 1, 2, 4]  # the one spare left
    assert trees["c"].tokens == [5] and out[2].q[:, 0].tolist() == [0, 1]  # none left: its first branch
