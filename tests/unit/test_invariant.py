"""Batch invariance on a tiny random model: a sequence's logits are bit-identical whatever shares its forward
and however many of its tokens the forward feeds (decode, verification, tree, prefill chunks), in fp32 and
bf16 (bf16 runs on every CPU, natively or not)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from calid.decoding.tree import TokenTree
from calid.models.invariant import InvariantLinear
from calid.runtime.runner import ModelRunner, SeqInput

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_rows_do_not_depend_on_the_other_rows(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 300, bias=True).to(dtype)
    inv = InvariantLinear.wrap(lin, 8)
    x = torch.randn(41, 96).to(dtype)
    whole = inv(x)
    assert all(torch.equal(whole[i], inv(x[i:i + 1])[0]) for i in range(41))
    assert torch.equal(inv(x.view(1, 41, 96))[0], whole)  # leading dims kept
    assert torch.allclose(whole.float(), lin(x).float(), atol=0.05 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_probed_linears_are_row_invariant_whichever_path_the_probe_chose(dtype):
    """rows="probe": one GEMM of any M >= 2 where the library is M-invariant for this shape, else fixed blocks."""
    from calid.models.invariant import use_invariant_linears

    torch.manual_seed(1)
    # 576 x 576 is SmolLM2's attention projection: on a CPU with AMX, oneDNN's bf16 GEMM of more than 32 rows
    # gives a few rows in its middle other bits than a GEMM of 2 (a probe of the first rows only missed it)
    model = nn.Sequential(nn.Linear(64, 576), nn.Linear(576, 576, bias=False), nn.Linear(576, 1000)).to(dtype)
    assert use_invariant_linears(model, "probe") == 3
    x = torch.randn(300, 64).to(dtype)
    whole = model(x)
    alone = torch.cat([model(x[i:i + 1]) for i in range(300)])
    assert torch.equal(whole, alone)  # every row
    assert torch.equal(model(x[:257])[256], whole[256])  # a last part of one row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576), (960, 576), (576, 1536)], ids=["o_proj", "qkv", "down"])
def test_the_probe_limit_is_one_every_row_keeps_its_2_row_bits_under(dtype, shape):
    """Every M up to the limit, every row of 512: a GEMM of M rows gives each row the bits it has in a GEMM of 2.
    (SmolLM2's shapes. On an AVX-512 CPU without native bf16, oneDNN's bf16 GEMM of 4-8 rows of a 576 x 576
    weight gives some rows other bits; a probe of one GEMM per M missed it and allowed 8 rows.)"""
    import torch.nn.functional as F

    from calid.models.invariant import ROW_LIMITS, max_invariant_rows

    torch.manual_seed(2)
    w = torch.randn(*shape).to(dtype)
    limit = max_invariant_rows(w)
    assert limit in ROW_LIMITS or limit == 0
    x = torch.randn(512, shape[1]).to(dtype)
    pairs = torch.cat([F.linear(x[i: i + 2], w) for i in range(0, 512, 2)])
    for m in range(2, limit + 1):
        order = torch.randperm(512)
        for rows in (order[i: i + m] for i in range(0, 512 - m + 1, m)):
            assert torch.equal(F.linear(x[rows], w), pairs[rows]), m


@pytest.fixture(params=DTYPES, ids=["fp32", "bf16"])
def runners(request, tiny_model):
    """(invariant runner,) over a copy of the tiny model in the given dtype (invariance converts its model)."""
    return (ModelRunner(copy.deepcopy(tiny_model).to(request.param), invariant=True),)


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 13 + 7 * j) % 90 + 3 for j in range(n)]


def _decode_alone(r, prompt: list[int], cont: list[int]) -> torch.Tensor:
    r.release("alone")
    rows = [r.forward([SeqInput("alone", prompt)])[0][0]]
    rows += [r.forward([SeqInput("alone", [t])])[0][0] for t in cont[:-1]]
    r.release("alone")
    return torch.stack(rows)


def test_decode_verify_batch_and_chunks_agree_bit_for_bit(runners):
    (inv,) = runners
    prompt, cont = _ids(1, 37), _ids(2, 9)
    ref = _decode_alone(inv, prompt, cont)  # logits after the prompt, then after each continuation token
    # verification: the whole continuation in one forward, logits at every row
    inv.forward([SeqInput("v", prompt[:-1])])
    got = inv.forward([SeqInput("v", [prompt[-1]] + cont[:-1], logits_at=list(range(len(cont))))])[0]
    assert torch.equal(got, ref)
    # the prompt prefilled in uneven chunks, beside other sequences decoding and prefilling
    others = {f"o{i}": _ids(10 + i, 5 + 11 * i) for i in range(4)}
    inv.forward([SeqInput(k, v) for k, v in others.items()])
    fed, rows = 0, []
    for size in (5, 17, 1, 14):
        out = inv.forward([SeqInput("c", prompt[fed:fed + size])] + [SeqInput(k, [3 + fed % 50]) for k in others])
        fed += size
    rows.append(out[0][0])
    for t in cont[:-1]:
        rows.append(inv.forward([SeqInput(k, [t + 1]) for k in others] + [SeqInput("c", [t])])[-1][0])
    assert torch.equal(torch.stack(rows), ref)


def test_a_token_tree_row_equals_decoding_its_branch(runners):
    (inv,) = runners
    prompt = _ids(3, 20)
    # root -> a -> b, and root -> c (a sibling branch)
    tree = TokenTree()
    for token, parent in ((11, -1), (12, 0), (13, -1)):
        tree.add(token, parent)
    inv.forward([SeqInput("t", prompt[:-1])])
    ancestors = tree.block_mask(1)
    positions = [len(prompt) - 1] + [len(prompt) + d - 1 for d in tree.depth]
    got = inv.forward([SeqInput("t", [prompt[-1]] + tree.tokens, positions=positions, ancestors=ancestors,
                                logits_at=[0, 1, 2, 3])])[0]
    branch_ab = _decode_alone(inv, prompt, [11, 12, 0])
    branch_c = _decode_alone(inv, prompt, [13, 0])
    assert torch.equal(got[0], branch_ab[0]) and torch.equal(got[1], branch_ab[1])
    assert torch.equal(got[2], branch_ab[2]) and torch.equal(got[3], branch_c[1])


def test_invariance_needs_the_paged_layout(tiny_model):
    with pytest.raises(ValueError, match="paged"):
        ModelRunner(copy.deepcopy(tiny_model), kv_layout="contiguous", invariant=True)
