import pytest
import torch
from torch import nn

from calid.models.cpu_linear import SkinnyLinear, use_skinny_linears


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 64, 65, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear_for_every_row_count(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias)
    skinny = SkinnyLinear.wrap(lin)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(skinny(x), lin(x), atol=1e-5, rtol=1e-5)


def test_transformation_shares_weights_and_keeps_outputs(tiny_model):
    import copy

    from calid.runtime.runner import ModelRunner, SeqInput

    model = copy.deepcopy(tiny_model)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    tokens = list(range(1, 11))
    ref = ModelRunner(model).forward([SeqInput("s", tokens, logits_at=list(range(10)))])[0]
    assert use_skinny_linears(model) == 2 * 4 + 1  # 4 linears per layer + head
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    got = ModelRunner(model).forward([SeqInput("s", tokens, logits_at=list(range(10)))])[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
