"""Twins: the n choices of one prompt are prefilled once and forked (calid.runtime.twins), on the torch runner."""
import pytest
import torch

from calid.runtime.runner import ModelRunner, SeqInput
from calid.runtime.twins import MIN_TWIN_TOKENS, find_twins

PROMPT = list(range(3, 3 + 2 * MIN_TWIN_TOKENS))


def alone(model, tokens, layout):
    return ModelRunner(model, kv_layout=layout).forward([SeqInput("x", tokens)])[0]


def test_twins_need_the_same_cache_a_shared_prefill_and_rows_their_leader_has():
    cached = {"a": [], "b": [], "c": [1], "d": [], "e": [], "f": [], "g": []}.__getitem__
    n = len(PROMPT)
    inputs = [SeqInput("a", PROMPT), SeqInput("b", PROMPT), SeqInput("c", PROMPT),
              SeqInput("d", PROMPT, logits_at=[0, 1]), SeqInput("e", PROMPT[:MIN_TWIN_TOKENS - 1]),
              SeqInput("f", PROMPT[:MIN_TWIN_TOKENS - 1]), SeqInput("g", PROMPT + [99], logits_at=[n - 1, n])]
    # c has a past, d asks rows a does not compute, e and f are too short; g shares the prompt, then a token
    assert find_twins(inputs, cached) == {1: (0, n), 6: (0, n)}
    assert find_twins([SeqInput("a", PROMPT), SeqInput("a", PROMPT)], cached) == {}  # the forward's error


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_twins_are_fed_once_and_go_on_as_if_each_had_been_prefilled(tiny_model, layout):
    runner = ModelRunner(tiny_model, kv_layout=layout)
    n = len(PROMPT)
    feeds = {"a": PROMPT, "b": PROMPT, "c": PROMPT + [9, 10]}  # c: the prompt and a draft of its own
    for s, ids in feeds.items():
        runner.sync(s, ids)
    out = runner.forward([SeqInput("a", PROMPT), SeqInput("b", PROMPT), SeqInput("c", feeds["c"],
                                                                                    logits_at=[n - 1, n, n + 1])])
    assert runner.stats.tokens == n + 2 and runner.stats.forked_sequences == 2
    # computed: a's prompt and c's own two ids (counted as sync does: a sequence's fed ids but the last)
    assert runner.stats.reused_tokens == 2 * n and runner.stats.recomputed_tokens == (n - 1) + (2 - 1)
    torch.testing.assert_close(out[0], alone(tiny_model, PROMPT, layout), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)
    ref_c = ModelRunner(tiny_model, kv_layout=layout).forward([SeqInput("x", feeds["c"], logits_at=[n - 1, n, n + 1])])
    torch.testing.assert_close(out[2], ref_c[0], atol=1e-5, rtol=1e-5)
    out[1][0, 0] = 1e9  # each twin has rows of its own
    assert out[0][0, 0] != 1e9
    # then each goes its own way on its own cache, as if it had prefilled the prompt itself
    nxt = {"a": [7], "b": [8], "c": [11]}
    steps = runner.forward([SeqInput(s, nxt[s]) for s in "abc"])
    assert runner.stats.forked_sequences == 2  # a decode step is nobody's twin
    for s, rows in zip("abc", steps):
        torch.testing.assert_close(rows, alone(tiny_model, feeds[s] + nxt[s], layout), atol=1e-5, rtol=1e-5)
    runner.release("a")  # the leader's cache going does not touch its twins'
    torch.testing.assert_close(runner.forward([SeqInput("b", [1])])[0],
                               alone(tiny_model, PROMPT + [8, 1], layout), atol=1e-5, rtol=1e-5)


def test_a_tree_after_a_shared_prompt_is_fed_on_the_twins_fork(tiny_model):
    """A tree verification's first call (the prompt, then the tree's nodes): the prompt is shared, each twin
    feeds only its own tree, and its rows are those of its whole input alone."""
    n = len(PROMPT)
    ancestors = torch.ones(n + 3, n + 3, dtype=torch.bool).tril()
    ancestors[n + 1, n] = False  # nodes: x at depth 1, y beside it, z under x
    ancestors[n + 2, n + 1] = False
    positions = list(range(n)) + [n, n, n + 1]
    rows = [n - 1, n, n + 1, n + 2]
    feeds = {"a": PROMPT + [5, 6, 7], "b": PROMPT + [8, 9, 10]}
    runner = ModelRunner(tiny_model)
    for s, ids in feeds.items():
        runner.sync(s, ids)
    out = runner.forward([SeqInput(s, ids, positions=positions, ancestors=ancestors, logits_at=rows)
                          for s, ids in feeds.items()])
    assert runner.stats.forked_sequences == 1 and runner.stats.tokens == n + 3 + 3
    for (s, ids), got in zip(feeds.items(), out):
        ref = ModelRunner(tiny_model).forward([SeqInput("x", ids, positions=positions, ancestors=ancestors,
                                                        logits_at=rows)])[0]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
