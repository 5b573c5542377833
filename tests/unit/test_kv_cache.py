import torch

from calid.runtime.kv_cache import NEAR_END, KVCache, KVCacheStore, common_prefix


def make(capacity=2):
    return KVCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", capacity=capacity)


def fill(cache, tokens):
    start = len(cache)
    cache.reserve(len(tokens))
    kv = torch.tensor([[[float(t), float(t)] for t in tokens]])  # [1, n, 2]
    for layer in range(cache.num_layers):
        cache.write(layer, start, kv, -kv)
    cache.commit(tokens)


def test_grows_and_keeps_contents():
    c = make(capacity=2)
    fill(c, [1, 2])
    fill(c, [3, 4, 5])
    assert c.capacity >= 5 and len(c) == 5
    k, v = c.view(1, 5)
    assert k[0, :, 0].tolist() == [1, 2, 3, 4, 5]
    assert v[0, :, 0].tolist() == [-1, -2, -3, -4, -5]


def test_truncate_and_common_prefix():
    c = make()
    fill(c, [1, 2, 3, 4])
    assert c.common_prefix([1, 2, 9, 4]) == 2
    assert c.common_prefix([1, 2]) == 2
    c.truncate(2)
    assert c.tokens == [1, 2]
    fill(c, [7])
    assert c.view(0, 3)[0][0, :, 0].tolist() == [1, 2, 7]


def test_keep_packs_accepted_rows():
    c = make()
    fill(c, [1, 2, 10, 11, 12, 13])  # prefix [1, 2] then a tree of 4 nodes
    c.keep([3, 5], start=2)  # accept nodes at rows 3 and 5
    assert c.tokens == [1, 2, 11, 13]
    assert c.view(0, 4)[0][0, :, 0].tolist() == [1, 2, 11, 13]


def test_store_evicts_least_recently_used_but_not_pinned():
    one = make(capacity=4).nbytes
    store = KVCacheStore(lambda: make(capacity=4), budget_bytes=2 * one)
    for sid in "abc":
        store.get(sid)
    store.get("a")  # a is now most recent; b is the oldest
    store.enforce_budget(pinned={"b"})
    assert "b" in store and "a" in store and "c" not in store
    assert store.evictions == 1


def test_store_without_budget_keeps_everything():
    store = KVCacheStore(lambda: make(), budget_bytes=None)
    for i in range(10):
        store.get(i)
    store.enforce_budget(pinned=set())
    assert len(store) == 10


def test_keep_of_rows_already_in_place_just_truncates():
    c = make()
    fill(c, [1, 2, 10, 11, 12])
    c.keep([2, 3], start=2)
    assert c.tokens == [1, 2, 10, 11]
    assert c.view(0, 4)[0][0, :, 0].tolist() == [1, 2, 10, 11]
    c.keep([], start=2)
    assert c.tokens == [1, 2]


def test_pipeline_stages_with_different_layer_counts_evict_the_same_sequences():
    """Stages of 3 and 2 layers charge their budget as the whole 5-layer model, so they evict alike."""
    def stage(layers):
        return KVCacheStore(lambda: KVCache(layers, 1, 2, torch.float32, "cpu", capacity=4, charged_layers=5),
                            budget_bytes=int(2.5 * KVCache(5, 1, 2, torch.float32, "cpu", capacity=4).nbytes))

    stores = [stage(3), stage(2)]
    for store in stores:
        for sid in "abcd":
            store.get(sid)
        store.enforce_budget(pinned={"d"})
    assert [sorted(s._caches) for s in stores] == [["c", "d"], ["c", "d"]]
    assert stores[1].get("c").nbytes * 5 == stores[1].get("c").charged_bytes * 2


def test_common_prefix_matches_a_token_by_token_scan():
    import random

    from calid.runtime.kv_cache import KVCache

    rng = random.Random(0)
    cache = KVCache(1, 1, 2, torch.float32, "cpu")
    for _ in range(300):
        cache.tokens = [rng.randrange(3) for _ in range(rng.randrange(12))]
        ids = [rng.randrange(3) for _ in range(rng.randrange(12))]
        want = next((i for i, (a, b) in enumerate(zip(cache.tokens, ids)) if a != b), min(len(cache.tokens), len(ids)))
        assert cache.common_prefix(ids) == want, (cache.tokens, ids)


def test_common_prefix_equals_a_token_loop_near_and_far_from_the_end():
    import random

    def loop(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 3 * NEAR_END))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, NEAR_END))]
        if b and rng.random() < 0.3:
            b[rng.randrange(len(b))] = 9  # a mismatch anywhere, far from the end included
        assert common_prefix(a, b) == loop(a, b)
