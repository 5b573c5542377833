"""The lookahead trie: exact drafts for hand-made token streams."""
from calid.decoding.lookahead import LookaheadConfig, LookaheadTrie


def trie(**kw):
    return LookaheadTrie(LookaheadConfig(**{"decoding_length": 8, "branch_length": 4, **kw}))


def test_retrieves_continuations_seen_in_the_prompt():
    t = trie()
    t.put_prompt("r", [1, 2, 3, 9, 1, 2, 4, 7])
    tree = t.retrieve([5, 1, 2])  # context ends in [1, 2]: seen followed by 3 and by 4
    assert sorted(tree.tokens[i] for i in tree.children(-1)) == [3, 4]
    # branches [1,2,3,...] and [1,2,4,...] share the [1, 2] prefix in the trie; the draft continues each
    assert tree.path(tree.tokens.index(9)) == [tree.tokens.index(3), tree.tokens.index(9)]


def test_longer_prefix_preferred_then_shortened():
    t = trie(max_prefix=3)
    t.put_prompt("r", [7, 8, 9, 6, 8, 9, 5])
    deep = t.retrieve([7, 8, 9])  # [7, 8, 9] followed by 6
    assert deep.tokens[0] == 6
    short = t.retrieve([0, 8, 9])  # [0, 8, 9] unseen; [8, 9] seen before 6 and before 5
    assert sorted(short.tokens[i] for i in short.children(-1)) == [5, 6]


def test_budget_and_frequency_order():
    t = trie(decoding_length=3)
    for _ in range(3):
        t.put_output([1, 2, 3, 4], new=4)
    t.put_output([1, 5, 6, 7], new=4)
    tree = t.retrieve([1])
    assert len(tree) == 3 and tree.tokens == [2, 3, 4]  # the frequent branch wins the budget


def test_eliminate_removes_a_finished_prompt():
    t = trie()
    t.put_prompt("a", [1, 2, 3, 4])
    t.put_prompt("b", [1, 2, 5])
    t.eliminate("a")
    tree = t.retrieve([1, 2])
    assert tree.tokens == [5]


def test_prune_keeps_live_prompt_nodes_and_frequent_output_nodes():
    t = trie(decoding_length=2, capacity_factor=2)  # capacity 4 nodes
    t.put_prompt("live", [1, 2, 3])
    size_prompt = t.size
    for i in range(10):
        t.put_output([50 + i, 60 + i, 70 + i], new=3)
    assert t.retrieve([1, 2]).tokens == [3]  # live prompt survives pruning
    assert t.size <= max(4, size_prompt)


def test_parallel_branches_are_side_by_side():
    t = trie(parallel=True)
    t.put_prompt("r", [1, 2, 3, 1, 2, 4])
    tree = t.retrieve([1])
    assert [tree.tokens[i] for i in tree.children(-1)] == [2, 2]  # not merged at the root


def test_owned_node_count_follows_live_prompts():
    t = trie()
    t.put_prompt("a", [1, 2, 3, 4])
    t.put_prompt("b", [1, 2, 5])
    assert 0 < t.owned == t.size
    t.put_output([9, 8, 7, 6, 5], new=5)  # output n-grams are not owned
    assert t.owned < t.size
    t.eliminate("a")
    t.eliminate("b")
    assert t.owned == 0
