"""The decoder over ragged batches, on a tiny random GQA model with qkv bias."""
import pytest
import torch

from calid.runtime.runner import ModelRunner, SeqInput


def full_logits(model, tokens):
    runner = ModelRunner(model)
    return runner.forward([SeqInput("x", tokens, logits_at=list(range(len(tokens))))])[0]


def test_incremental_equals_full_prefill(tiny_model):
    tokens = [5, 17, 3, 88, 41, 9, 60]
    ref = full_logits(tiny_model, tokens)
    runner = ModelRunner(tiny_model)
    a = runner.forward([SeqInput("s", tokens[:3], logits_at=[0, 1, 2])])[0]
    b = runner.forward([SeqInput("s", tokens[3:4])])[0]
    c = runner.forward([SeqInput("s", tokens[4:], logits_at=[0, 1, 2])])[0]
    torch.testing.assert_close(torch.cat([a, b, c]), ref, atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_each_sequence_alone(tiny_model):
    seqs = {"a": [1, 2, 3, 4, 5], "b": [9], "c": [7, 7, 8]}
    runner = ModelRunner(tiny_model)
    runner.forward([SeqInput("a", seqs["a"][:2])])  # a has a cached past, b and c do not
    out = runner.forward([
        SeqInput("a", seqs["a"][2:], logits_at=[0, 1, 2]),
        SeqInput("b", seqs["b"]),
        SeqInput("c", seqs["c"], logits_at=[0, 2]),
    ])
    torch.testing.assert_close(out[0], full_logits(tiny_model, seqs["a"])[2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], full_logits(tiny_model, seqs["b"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2], full_logits(tiny_model, seqs["c"])[[0, 2]], atol=1e-5, rtol=1e-5)


def test_explicit_causal_ancestor_mask_equals_default(tiny_model):
    tokens = [4, 8, 15, 16, 23, 42]
    ref = full_logits(tiny_model, tokens)
    runner = ModelRunner(tiny_model)
    runner.forward([SeqInput("t", tokens[:2])])
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    out = runner.forward([SeqInput("t", tokens[2:], ancestors=causal, logits_at=[0, 1, 2, 3])])[0]
    torch.testing.assert_close(out, ref[2:], atol=1e-5, rtol=1e-5)


def test_tree_mask_branches_do_not_see_each_other(tiny_model):
    # prefix [3, 1] then a tree: root 2 with children 30 and 40 (both at depth 1)
    prefix = [3, 1]
    runner = ModelRunner(tiny_model)
    runner.forward([SeqInput("t", prefix)])
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out = runner.forward([SeqInput("t", [2, 30, 40], positions=[2, 3, 3], ancestors=ancestors, logits_at=[1, 2])])[0]
    torch.testing.assert_close(out[0], full_logits(tiny_model, prefix + [2, 30])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], full_logits(tiny_model, prefix + [2, 40])[-1], atol=1e-5, rtol=1e-5)


def test_sync_reuses_the_longest_prefix_and_rolls_back(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward([SeqInput("s", [1, 2, 3, 4])])
    assert runner.sync("s", [1, 2, 3, 4, 5, 6]) == [5, 6]
    assert runner.sync("s", [1, 2, 9]) == [9]  # rolled back to [1, 2]
    assert runner.cached_length("s") == 2
    assert runner.sync("s", [1, 2]) == [2]  # fully cached: the last token is fed again for its logits


def test_eviction_under_budget_then_recompute_gives_same_logits(tiny_model):
    tokens = [5, 6, 7, 8]
    ref = full_logits(tiny_model, tokens)[-1]
    runner = ModelRunner(tiny_model, kv_budget_bytes=1)  # every idle cache is evicted
    runner.forward([SeqInput("a", runner.sync("a", tokens[:3]))])
    runner.forward([SeqInput("b", runner.sync("b", [1, 2]))])
    assert runner.caches.evictions >= 1 and "a" not in runner.caches
    out = runner.forward([SeqInput("a", runner.sync("a", tokens))])[0][0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert runner.stats.recomputed_tokens >= 3


def test_bad_batches_are_refused(tiny_model):
    runner = ModelRunner(tiny_model)
    with pytest.raises(ValueError, match="no new tokens"):
        runner.forward([SeqInput("a", [])])
    with pytest.raises(ValueError, match="twice"):
        runner.forward([SeqInput("a", [1]), SeqInput("a", [2])])
