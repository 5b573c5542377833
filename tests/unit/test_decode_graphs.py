"""Decode graphs' padded static step (calid.runtime.graphs), checked on the CPU against the ordinary paged forward.

The CUDA capture of the same step is tested in tests/engine/test_gpu.py (skipped without a GPU).
"""
import pytest
import torch

from calid.runtime.runner import ModelRunner, SeqInput


def prompts(n):
    # lengths straddle block boundaries (blocks of 16) and differ, so tables and masks are ragged
    return {f"s{i}": [(5 * i + j) % 90 + 3 for j in range(9 + 7 * i)] for i in range(n)}


def decode(runner, ids, steps, active=None):
    """Greedy decode ``steps`` tokens of the sequences in ``active`` (default all); logits of every step."""
    out = []
    for _ in range(steps):
        names = active or list(ids)
        logits = runner.forward([SeqInput(n, runner.sync(n, ids[n])) for n in names])
        for n, row in zip(names, logits):
            ids[n].append(int(row[-1].argmax()))
        out.append(torch.cat(logits))
    return out


def test_static_decode_step_equals_the_paged_forward_through_padding_and_rollback(tiny_model):
    plain, static = ModelRunner(tiny_model), ModelRunner(tiny_model, graphs="static", graph_batch_sizes=(1, 4))
    ids = {"plain": prompts(3), "static": prompts(3)}
    runners = {"plain": plain, "static": static}
    logits = {k: decode(r, ids[k], 6) for k, r in runners.items()}  # prefill (eager), then 3 sequences in bucket 4
    for k, r in runners.items():  # roll one sequence back, then decode only two of them (a padded row was real)
        ids[k]["s1"] = ids[k]["s1"][:-4]
        logits[k] += decode(r, ids[k], 5, active=["s1", "s2"])
        logits[k] += decode(r, ids[k], 3)  # and all three again: s0's rows were never touched by padding
    assert ids["static"] == ids["plain"]
    for a, b in zip(logits["plain"], logits["static"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert static.graphs.replays >= 13 and static.graphs.captures == 0


def test_only_plain_decode_steps_take_the_static_path(tiny_model):
    runner = ModelRunner(tiny_model, graphs="static", graph_batch_sizes=(1, 2))
    runner.forward([SeqInput("a", [1, 2, 3])])  # a prompt: several tokens
    runner.forward([SeqInput("a", [4, 5], ancestors=torch.tensor([[True, False], [True, True]]))])
    runner.forward([SeqInput(s, [7]) for s in "bcd"])  # three sequences: larger than the largest bucket
    assert runner.graphs.replays == 0
    runner.forward([SeqInput("a", [6])])
    assert runner.graphs.replays == 1


def test_a_growing_pool_rebuilds_the_static_steps_and_keeps_the_rows(tiny_model):
    plain, static = ModelRunner(tiny_model), ModelRunner(tiny_model, graphs="static")
    pool = static.graphs.pool
    ids = {"plain": prompts(2), "static": prompts(2)}
    decode(plain, ids["plain"], 2)
    decode(static, ids["static"], 2)
    blocks = pool.num_blocks
    for r, k in ((plain, "plain"), (static, "static")):  # long prompts take more blocks than the pool has
        long = {f"long{i}": [(i + j) % 90 + 3 for j in range(120)] for i in range(blocks // 8 + 1)}
        r.forward([SeqInput(n, p) for n, p in long.items()])
    assert pool.num_blocks > blocks
    decode(plain, ids["plain"], 3)
    decode(static, ids["static"], 3)
    assert ids["static"] == ids["plain"]


def test_graphs_need_cuda_and_the_paged_layout(tiny_model):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            ModelRunner(tiny_model, graphs="cuda")
    with pytest.raises(ValueError, match="paged"):
        ModelRunner(tiny_model, graphs="static", kv_layout="contiguous")
    with pytest.raises(ValueError, match="graphs must be one of"):
        ModelRunner(tiny_model, graphs="sometimes")
