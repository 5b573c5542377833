"""calid bench gpu's pieces on CPU: random models of a shape, the HF twin on shared weights, the mode checks."""
import json

import pytest
import torch

from calid.bench.gpu import check_greedy_modes, hf_twin, main, random_model, shape_config, weight_read_bytes


def test_hf_twin_shares_the_weights_and_gives_the_same_logits():
    from calid.runtime.runner import ModelRunner, SeqInput

    model = random_model(shape_config("tiny"), torch.float32, "cpu", seed=3, std=0.1)
    hf = hf_twin(model)
    assert hf.model.layers[0].mlp.down_proj.weight.data_ptr() == model.layers[0].mlp.w_down.weight.data_ptr()
    ids = [5, 9, 100, 7, 300]
    ours = ModelRunner(model).forward([SeqInput("x", ids, logits_at=list(range(len(ids))))])[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_real_shapes_are_the_published_sizes():
    """Parameter counts from the shapes alone (no weights built): Qwen2.5-7B has 7.6B, 0.5B has 0.49B."""
    def params(name):
        c = shape_config(name)
        attn = c.hidden_size * (c.q_size + 2 * c.kv_size) + (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
        head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return c.num_layers * layer + c.vocab_size * c.hidden_size + head + c.hidden_size
    assert 7.5e9 < params("qwen2.5-7b") < 7.7e9
    assert 0.48e9 < params("qwen2.5-0.5b") < 0.5e9
    tiny = random_model(shape_config("tiny"), torch.float32, "cpu")
    assert weight_read_bytes(tiny) == 4 * (sum(p.numel() for p in tiny.parameters()) - tiny.embed.weight.numel())


def test_greedy_modes_agree_on_cpu():
    same = check_greedy_modes("cpu")
    assert set(same) >= {"speculative", "tree", "lookahead", "auto", "ar+graphs", "speculative+graphs"}
    assert all(same.values()), same


def test_smoke_run_on_cpu_writes_the_table(tmp_path, capsys):
    assert main(["--pair", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "2",
                 "--new-tokens", "6", "--prompt-len", "5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu-tiny.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["ar", "ar+graphs", "speculative", "tree", "hf generate"]
    assert all(r["same_as_ar"] for r in rows)  # fp32: the HF twin's greedy tokens are ours
    assert "ratio_vs_hf" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_without_cuda_the_cli_says_so_in_one_line(capsys):
    assert main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
