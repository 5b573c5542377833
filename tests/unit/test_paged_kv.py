"""The paged KV cache (block pool + block tables) and the batched attention over it."""
import pytest
import torch

from calid.runtime.attention import SHORT_QUERY, PagedAttention, attention_for
from calid.runtime.kv_cache import KVCacheStore
from calid.runtime.paged import BlockPool, PagedKVCache
from calid.runtime.runner import ModelRunner, SeqInput


def pool(blocks=2, block_size=4):
    return BlockPool(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                     block_size=block_size, blocks=blocks)


def fill(cache, tokens):
    start = len(cache)
    cache.reserve(len(tokens))
    slots = torch.tensor(cache.slots(start, len(tokens)))
    kv = torch.tensor([[[float(t), float(t)]] for t in tokens])  # [n, 1 head, 2]
    for layer in range(cache.num_layers):
        cache.pool.write(layer, slots, kv, -kv)
    cache.commit(tokens)


def rows(cache, layer=0):
    k, v = cache.pool.flat(layer)
    slots = torch.tensor(cache.slots(0, len(cache)))
    return k[0, slots, 0].tolist(), v[0, slots, 0].tolist()


def test_pool_grows_and_keeps_every_sequences_rows():
    p = pool(blocks=2)
    a, b = PagedKVCache(p), PagedKVCache(p)
    fill(a, [1, 2, 3])
    fill(b, [7, 8, 9, 10, 11])  # 2 blocks: one more than the pool has left, so it doubles
    fill(a, [4, 5, 6])
    assert p.num_blocks == 4 and p.free_blocks == 0 and len(a.blocks) == 2 and len(b.blocks) == 2
    assert rows(a) == ([1, 2, 3, 4, 5, 6], [-1, -2, -3, -4, -5, -6])
    assert rows(b, layer=1)[0] == [7, 8, 9, 10, 11]


def test_rollback_and_release_give_blocks_back_at_once():
    p = pool(blocks=8)
    c = PagedKVCache(p)
    fill(c, list(range(10)))  # 3 blocks of 4
    assert p.free_blocks == 5
    c.truncate(5)  # 2 blocks still needed
    assert len(c.blocks) == 2 and p.free_blocks == 6 and c.tokens == [0, 1, 2, 3, 4]
    fill(c, [50])
    assert rows(c)[0] == [0, 1, 2, 3, 4, 50]
    c.release()
    assert p.free_blocks == 8 and len(c) == 0


def test_keep_packs_the_accepted_tree_rows_across_blocks():
    c = PagedKVCache(pool(blocks=4))
    fill(c, [1, 2, 10, 11, 12, 13, 14])  # prefix [1, 2], then 5 tree nodes over two blocks
    c.keep([3, 6], start=2)
    assert c.tokens == [1, 2, 11, 14] and rows(c)[0] == [1, 2, 11, 14] and len(c.blocks) == 1


def test_store_frees_blocks_of_evicted_and_dropped_sequences():
    p = pool(blocks=8)
    store = KVCacheStore(lambda: PagedKVCache(p), budget_bytes=2 * p.block_bytes())
    for sid in "abc":
        fill(store.get(sid), [1, 2, 3])  # one block each
    store.enforce_budget(pinned={"a"})
    assert "a" in store and "b" not in store and p.free_blocks == 6
    store.drop("a")
    assert p.free_blocks == 7


def test_a_growing_sequence_gets_consecutive_blocks_and_reads_a_slice(tiny_model):
    runner = ModelRunner(tiny_model)
    runner.forward([SeqInput("s", list(range(1, 40)))])
    runner.forward([SeqInput("s", [5])])
    cache = runner.caches.get("s")
    assert cache.consecutive
    batch = runner._build_batch([SeqInput("s", [6])])
    (group,) = attention_for(batch).groups
    assert group.blocks is None  # no gather


def full_logits(model, tokens, layout):
    return ModelRunner(model, kv_layout=layout).forward(
        [SeqInput("x", tokens, logits_at=list(range(len(tokens))))])[0]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_mixed_batch_equals_each_sequence_alone(tiny_model, layout):
    """Decode, a verification chunk, a token tree and prefill chunks of two size classes in one forward."""
    torch.manual_seed(1)
    ids = {n: torch.randint(1, 97, (60,)).tolist() for n in "abcdef"}
    runner = ModelRunner(tiny_model, kv_layout=layout)
    for n, past in zip("abcd", (20, 9, 33, 3)):  # interleaved prefills: block tables are not consecutive
        runner.forward([SeqInput(n, ids[n][:past])])
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = ids["c"][33:34] + [41, 42]
    out = runner.forward([
        SeqInput("a", ids["a"][20:21]),  # decode
        SeqInput("b", ids["b"][9:14], logits_at=[0, 1, 2, 3, 4]),  # verification of 4 drafts
        SeqInput("c", tree, positions=[33, 34, 34], ancestors=ancestors, logits_at=[1, 2]),  # a tree
        SeqInput("d", ids["d"][3:3 + SHORT_QUERY + 4], logits_at=[0, SHORT_QUERY + 3]),  # a longer chunk
        SeqInput("e", ids["e"][:45], logits_at=[44]),  # a prefill in the next size class
        SeqInput("f", ids["f"][:1]),
    ])
    if layout == "paged":
        assert len(attention_for(runner._build_batch([
            SeqInput("a", [1]), SeqInput("d", [1] * 20), SeqInput("e", [1] * 40)])).groups) == 3
    ref = {n: full_logits(tiny_model, ids[n][:60], "contiguous") for n in "abdef"}
    close = lambda a, b: torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)  # noqa: E731
    close(out[0][0], ref["a"][20])
    close(out[1], ref["b"][9:14])
    close(out[2][0], full_logits(tiny_model, ids["c"][:34] + [41], "contiguous")[-1])
    close(out[2][1], full_logits(tiny_model, ids["c"][:34] + [42], "contiguous")[-1])
    close(out[3], ref["d"][[3, 3 + SHORT_QUERY + 3]])
    close(out[4][0], ref["e"][44])
    close(out[5][0], ref["f"][0])


def test_paged_attention_plans_one_call_for_a_decode_batch(tiny_model):
    runner = ModelRunner(tiny_model)
    for n in range(5):
        runner.forward([SeqInput(n, [n + 1] * (3 + 7 * n))])
    plan = attention_for(runner._build_batch([SeqInput(n, [9]) for n in range(5)]))
    assert isinstance(plan, PagedAttention) and len(plan.groups) == 1
    (group,) = plan.groups
    assert group.size == 5 and group.q_max == 1 and group.rows is None  # q read in place


def test_unknown_kv_layout_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_layout"):
        ModelRunner(tiny_model, kv_layout="ring")
